"""The soak tool (bench/soak.py, bench/soak_traffic.py): its traffic mix, the verdict on each answer, the
RSS arithmetic, and the tool end to end against a small fake server on loopback.

The fake server answers as carpool's contract says (400 with a JSON body for bad input, 413 over the
body limit, 504 past a deadline) unless told to misbehave, so that a soak against it passes, and one
against a misbehaving fake fails with the right verdict.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from bench import soak as soak_tool
from bench.server import process_tree
from bench.soak import Pool, send, tree_rss_bytes
from bench.soak_traffic import (
    DEFAULT_MIX,
    GRACE_S,
    TIMEOUT_HEADER,
    Answer,
    Disconnect,
    Kind,
    Limits,
    Probe,
    TrafficBuilder,
    Verdict,
    arrival_rate,
    classify,
    plan_kinds,
    plan_traffic,
    rss_growth,
    stream_complete,
    tally,
)

HOST = "127.0.0.1"
LIMITS = Limits("fake", max_input_tokens=64, max_items=16, max_body_bytes=4096, default_timeout_s=5.0)
TEXTS = ["a short text", "another one here", "and a third"]


def builder(generation: bool = False) -> TrafficBuilder:
    limits = Limits(**{**LIMITS.__dict__, "generation": generation})
    return TrafficBuilder(limits, HOST, 8000, TEXTS)


def body_of(probe: Probe) -> bytes:
    return probe.data.split(b"\r\n\r\n", 1)[1]


# -- the mix ------------------------------------------------------------------------------------------


def test_the_mix_follows_its_weights_and_its_seed() -> None:
    kinds = plan_kinds(random.Random(3), 20_000, DEFAULT_MIX)
    counts = Counter(kinds)
    total = sum(DEFAULT_MIX.values())
    for kind, weight in DEFAULT_MIX.items():
        assert counts[kind] / len(kinds) == pytest.approx(weight / total, abs=0.015), kind
    assert plan_kinds(random.Random(3), 500, DEFAULT_MIX) == kinds[:500]
    assert plan_kinds(random.Random(4), 500, DEFAULT_MIX) != kinds[:500]
    only_bad = plan_kinds(random.Random(0), 200, {Kind.MALFORMED: 1.0, Kind.NORMAL: 0.0})
    assert set(only_bad) == {Kind.MALFORMED}


def test_the_same_seed_sends_the_same_bytes() -> None:
    first = plan_traffic(builder(), 300, seed=11, mix=DEFAULT_MIX)
    again = plan_traffic(builder(), 300, seed=11, mix=DEFAULT_MIX)
    other = plan_traffic(builder(), 300, seed=12, mix=DEFAULT_MIX)
    assert [p.data for p in first] == [p.data for p in again]
    assert [p.data for p in first] != [p.data for p in other]


@pytest.mark.parametrize("generation", [False, True])
def test_each_class_carries_what_it_claims(generation: bool) -> None:
    probes = plan_traffic(builder(generation), 1500, seed=5, mix=dict.fromkeys(Kind, 1.0))
    seen = {(p.kind, p.variant) for p in probes}
    variants = {kind: {v for k, v in seen if k is kind} for kind in Kind}
    assert {"tokens_over_limit", "too_many_inputs", "body_over_limit", "chunked_over_limit"} <= variants[
        Kind.OVERSIZED
    ]
    assert {"bad_json", "unknown_field", "wrong_method", "bad_timeout_header"} <= variants[Kind.MALFORMED]
    field = "prompt" if generation else "input"
    for probe in probes:
        head = probe.data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
        if probe.kind is Kind.NORMAL:
            assert probe.allowed == {200} and probe.budget_s == LIMITS.default_timeout_s + GRACE_S
            assert field in json.loads(body_of(probe))
        elif probe.kind is Kind.DEADLINE:
            deadline = float(head.split(f"{TIMEOUT_HEADER}: ", 1)[1].split("\r\n", 1)[0])
            assert 0.05 <= deadline <= 0.5
            assert probe.allowed == {200, 504} and probe.budget_s == pytest.approx(deadline + GRACE_S)
        elif probe.kind is Kind.DISCONNECT:
            assert probe.disconnect is not None and not probe.reusable
            if probe.disconnect is Disconnect.AFTER_FIRST_BYTES:
                assert generation and json.loads(body_of(probe))["stream"] is True
        elif probe.kind is Kind.OVERSIZED:
            assert probe.allowed == {400, 413}
            if probe.variant == "body_over_limit":
                assert len(body_of(probe)) > LIMITS.max_body_bytes and not probe.reusable
            elif probe.variant == "tokens_over_limit":
                assert len(json.loads(body_of(probe))[field].split()) > LIMITS.max_input_tokens
            elif probe.variant == "too_many_inputs":
                assert len(json.loads(body_of(probe))[field]) > (1 if generation else LIMITS.max_items)
        else:
            assert 200 not in probe.allowed or probe.variant == "wrong_content_type"
            assert all(400 <= code < 500 for code in probe.allowed - {200})


def test_the_rate_loads_the_model_at_the_share_asked() -> None:
    mix = {Kind.NORMAL: 0.5, Kind.DEADLINE: 0.25, Kind.MALFORMED: 0.25}
    assert arrival_rate(100.0, 0.8, mix) == pytest.approx(80.0 / 0.75)
    assert arrival_rate(100.0, 0.8, {Kind.NORMAL: 1.0}) == pytest.approx(80.0)


# -- verdicts -----------------------------------------------------------------------------------------

NORMAL = Probe(Kind.NORMAL, "plain", b"", frozenset({200}), 31.0)
DEADLINE = Probe(Kind.DEADLINE, "0.10s", b"", frozenset({200, 504}), 1.1, streaming=True)
OVERSIZED = Probe(Kind.OVERSIZED, "too_many_inputs", b"", frozenset({400, 413}), 31.0)
MALFORMED = Probe(Kind.MALFORMED, "bad_json", b"", frozenset(range(400, 500)), 31.0)
DROPPED = Probe(Kind.DISCONNECT, "after_delay", b"", frozenset({200}), 31.0, Disconnect.AFTER_DELAY, 0.1)
STREAM = Probe(Kind.NORMAL, "stream", b"", frozenset({200}), 31.0, streaming=True)
DONE = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
ERROR_EVENT = b'data: {"error": {"message": "deadline"}}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize(
    ("probe", "answer", "verdict"),
    [
        (NORMAL, Answer(200, 0.01), Verdict.OK),
        (NORMAL, Answer(429, 0.01, retry_after=True), Verdict.OVERLOAD),
        (NORMAL, Answer(503, 0.01, retry_after=True), Verdict.OVERLOAD),
        (NORMAL, Answer(503, 0.01), Verdict.SERVER_ERROR),
        (NORMAL, Answer(429, 0.01), Verdict.WRONG_STATUS),
        (NORMAL, Answer(500, 0.01), Verdict.SERVER_ERROR),
        (NORMAL, Answer(504, 30.0), Verdict.SERVER_ERROR),
        (NORMAL, Answer(400, 0.01), Verdict.WRONG_STATUS),
        (NORMAL, Answer(None, 31.0, hung=True), Verdict.HUNG),
        (NORMAL, Answer(None, 0.01), Verdict.NO_ANSWER),
        (DEADLINE, Answer(504, 0.2), Verdict.OK),
        (DEADLINE, Answer(200, 0.2, body=DONE), Verdict.OK),
        (DEADLINE, Answer(200, 0.2, body=ERROR_EVENT), Verdict.OK),
        (DEADLINE, Answer(200, 0.2, body=b'data: {"choices": []}\n\n'), Verdict.BROKEN_STREAM),
        (DEADLINE, Answer(None, 1.1, hung=True), Verdict.HUNG),
        (STREAM, Answer(200, 0.5, body=DONE), Verdict.OK),
        (STREAM, Answer(200, 0.5, body=ERROR_EVENT), Verdict.BROKEN_STREAM),
        (OVERSIZED, Answer(413, 0.01), Verdict.OK),
        (OVERSIZED, Answer(400, 0.01), Verdict.OK),
        (OVERSIZED, Answer(200, 0.01), Verdict.WRONG_STATUS),
        (OVERSIZED, Answer(500, 0.01), Verdict.SERVER_ERROR),
        (MALFORMED, Answer(422, 0.01), Verdict.OK),
        (MALFORMED, Answer(200, 0.01), Verdict.WRONG_STATUS),
        (MALFORMED, Answer(502, 0.01), Verdict.SERVER_ERROR),
        (DROPPED, Answer(None, 0.1, disconnected=True), Verdict.DISCONNECTED),
        (DROPPED, Answer(200, 0.05), Verdict.OK),
        (DROPPED, Answer(500, 0.05), Verdict.SERVER_ERROR),
        (DROPPED, Answer(500, 0.05, disconnected=True), Verdict.SERVER_ERROR),
    ],
)
def test_the_verdict_on_each_answer(probe: Probe, answer: Answer, verdict: Verdict) -> None:
    assert classify(probe, answer) is verdict


def test_failures_are_the_verdicts_that_break_a_bar() -> None:
    assert {v for v in Verdict if v.failed} == {
        Verdict.HUNG,
        Verdict.NO_ANSWER,
        Verdict.SERVER_ERROR,
        Verdict.WRONG_STATUS,
        Verdict.BROKEN_STREAM,
    }
    assert not stream_complete(b"")
    assert stream_complete(DONE)


def test_tally_counts_statuses_and_hung_per_class() -> None:
    results = [
        (NORMAL, Answer(200, 0.010), Verdict.OK),
        (NORMAL, Answer(200, 0.030), Verdict.OK),
        (NORMAL, Answer(None, 31.0, hung=True), Verdict.HUNG),
        (DROPPED, Answer(None, 0.1, disconnected=True), Verdict.DISCONNECTED),
    ]
    stats = tally(results)
    normal = stats["normal"].summary()
    assert normal["sent"] == 3 and normal["hung"] == 1
    assert normal["statuses"] == {"200": 2, "hung": 1}
    assert normal["p50_ms"] == pytest.approx(20.0)  # hung requests have no latency to count
    assert stats["disconnect"].summary()["statuses"] == {"dropped": 1}


# -- RSS ----------------------------------------------------------------------------------------------


def test_rss_growth_compares_the_end_with_the_window_after_warm_up() -> None:
    flat = [(float(t), 100.0) for t in range(100)]
    assert rss_growth(flat, 100.0) == 0.0
    warming = [(float(t), 50.0 if t < 20 else 100.0) for t in range(100)]
    assert rss_growth(warming, 100.0) == 0.0  # the first 20% does not count
    leaking = [(float(t), 100.0 + t) for t in range(100)]
    base = sum(100.0 + t for t in range(20, 30)) / 10
    tail = sum(100.0 + t for t in range(90, 100)) / 10
    assert rss_growth(leaking, 100.0) == pytest.approx((tail - base) / base)
    assert math.isnan(rss_growth([], 100.0))
    assert math.isnan(rss_growth([(0.0, 1.0)], 100.0))


def _fake_proc(root: Path, tree: dict[int, tuple[int, int]]) -> None:
    for pid, (ppid, pages) in tree.items():
        folder = root / str(pid)
        folder.mkdir()
        (folder / "stat").write_text(f"{pid} (python (x)) S {ppid} 1 1 0")
        (folder / "statm").write_text(f"{pages * 3} {pages} 0 0 0 0 0")


def test_rss_sums_the_whole_process_tree(tmp_path: Path) -> None:
    # 10 is the server, 11 and 12 its children, 13 a grandchild; 20 and 21 are not its own.
    _fake_proc(tmp_path, {10: (1, 100), 11: (10, 10), 12: (10, 20), 13: (12, 5), 20: (1, 999), 21: (20, 7)})
    (tmp_path / "self").mkdir()
    assert sorted(process_tree(10, tmp_path)) == [10, 11, 12, 13]
    page = os.sysconf("SC_PAGE_SIZE")
    assert tree_rss_bytes(10, tmp_path) == (135 * page, 4)
    assert tree_rss_bytes(13, tmp_path) == (5 * page, 1)


# -- against a fake server ----------------------------------------------------------------------------


class FakeServer:
    """Enough of carpool's HTTP contract for the soak: limits, /metrics, readiness, and
    /v1/embeddings that answers 200, 400, 413 or 504 as carpool would. `misbehave(text)` may return
    "500" or "hang" for a normal request's text."""

    def __init__(self, misbehave: Callable[[str], str | None] = lambda text: None) -> None:
        self.misbehave = misbehave
        self.port = 0
        self.answered: Counter[int] = Counter()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, HOST, 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        server.close()
        handlers = asyncio.all_tasks(self.loop)  # the hanging ones: end them while the loop still runs
        for task in handlers:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*handlers, return_exceptions=True))
        self.loop.run_until_complete(server.wait_closed())
        self.loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                line, *header_lines = head[:-4].split("\r\n")
                method, path, _ = line.split(" ")
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)
                }
                if headers.get("transfer-encoding") == "chunked":
                    body = b""
                    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                        body += await reader.readexactly(size)
                        await reader.readexactly(2)
                    await reader.readexactly(2)
                else:
                    body = await reader.readexactly(int(headers.get("content-length", 0)))
                status, payload = await self._answer(method, path, headers, body)
                if status == 0:
                    await asyncio.sleep(3600)  # hang
                self.answered[status] += 1
                data = payload.encode()
                head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                writer.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str]:
        if method == "GET":
            pages = {
                "/v1/models": '{"data": [{"id": "fake"}]}',
                "/v2/models/fake": '{"parameters": {"max_input_tokens": 200}}',
                "/v2/health/ready": "{}",
                "/metrics": 'carpool_inflight_requests{model="fake"} 0\ncarpool_queue_depth{model="fake"} 0\n'
                + "".join(
                    f'carpool_requests_total{{model="fake",status="{code}"}} {n}\n'
                    for code, n in self.answered.items()
                ),
            }
            if path in pages:
                return 200, pages[path]
            return (405, "{}") if path == "/v1/embeddings" else (404, "{}")
        if path != "/v1/embeddings":
            return 404, "{}"
        if len(body) > 65536:
            return 413, '{"error": "too large"}'
        try:
            timeout = float(headers.get(TIMEOUT_HEADER, "5"))
            request = json.loads(body)
            texts = [request["input"]] if isinstance(request["input"], str) else request["input"]
            assert set(request) == {"input"} and isinstance(texts, list) and 0 < len(texts) <= 16
            assert all(isinstance(t, str) and t and len(t.split()) <= 200 and len(t) < 4096 for t in texts)
        except (ValueError, KeyError, AssertionError, TypeError):
            return 400, '{"error": "bad request"}'
        behaviour = self.misbehave(texts[0])
        if behaviour == "hang":
            return 0, ""
        if behaviour == "500":
            return 500, '{"error": "boom"}'
        await asyncio.sleep(min(0.02, timeout))
        return (504, "{}") if timeout < 0.02 else (200, '{"data": []}')


def run_tool(server: FakeServer, tmp_path: Path, *extra: str) -> tuple[int, dict[str, object]]:
    out = tmp_path / "soak.json"
    args = ["--port", str(server.port), "--pid", str(os.getpid()), "--rss-period", "0.1"]
    args += ["--rate", "60", "--duration", "2", "--json", str(out)]
    args += ["--max-body-bytes", "65536", "--max-items", "16", "--default-timeout", "2", *extra]
    code = soak_tool.main(args)
    return code, json.loads(out.read_text())


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server


@pytest.mark.slow
def test_a_soak_against_a_server_that_keeps_its_contract_passes(fake: FakeServer, tmp_path: Path) -> None:
    code, report = run_tool(fake, tmp_path)
    classes = report["classes"]
    assert isinstance(classes, dict)
    assert all(classes[kind.value]["sent"] > 0 for kind in Kind)
    assert report["server_errors"] == report["hung"] == report["no_answer"] == report["wrong"] == 0
    assert report["server_counted_errors"] == 0
    assert report["failures"] == []
    assert code == 0


@pytest.mark.slow
def test_a_soak_reports_5xx_and_hung_requests_and_fails(tmp_path: Path) -> None:
    def misbehave(text: str) -> str | None:
        return {0: "500", 1: "hang"}.get(len(text) % 7)

    with FakeServer(misbehave) as server:
        code, report = run_tool(
            server, tmp_path, "--mix", "normal=1,disconnect=0,oversized=0,malformed=0,deadline=0"
        )
    assert code == 1
    assert isinstance(report["server_errors"], int) and report["server_errors"] > 0
    assert isinstance(report["hung"], int) and report["hung"] > 0
    assert report["server_counted_errors"] == report["server_errors"]  # /metrics agrees
    failures = report["failures"]
    assert isinstance(failures, list)
    assert {f["verdict"] for f in failures} == {"5xx", "hung"}
    assert all(f["class"] == "normal" for f in failures)


async def test_send_judges_hangs_by_the_budget_and_drops_on_purpose(fake: FakeServer) -> None:
    hang = FakeServer(lambda text: "hang")
    with hang:
        pool = Pool(HOST, hang.port, asyncio.get_running_loop().time)
        probe = builder().build(Kind.NORMAL, random.Random(0))
        quick = Probe(probe.kind, probe.variant, probe.data, probe.allowed, budget_s=0.2)
        answer = await send(quick, pool)
        pool.close()
    assert answer.hung and answer.status is None and classify(quick, answer) is Verdict.HUNG
    pool = Pool(HOST, fake.port, asyncio.get_running_loop().time)
    dropped = Probe(Kind.DISCONNECT, "after_send", quick.data, frozenset({200}), 1.0, Disconnect.AFTER_SEND)
    assert classify(dropped, await send(dropped, pool)) is Verdict.DISCONNECTED
    answer = await send(Probe(Kind.NORMAL, "plain", quick.data, frozenset({200}), 1.0), pool)
    assert answer.status == 200 and pool.idle  # kept alive for the next request
    pool.close()
