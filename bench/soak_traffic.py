"""The soak's pure parts: the seeded traffic mix, the verdict on each answer, RSS growth, the report.

`bench.soak` sends what `plan_traffic` builds and judges each answer with `classify`; nothing here does
I/O, so tests/test_soak.py checks the mix, the rules and the arithmetic without a server.

Classes of request, and what each must get back (anything else is a failure):
- normal: 200. 429 or 503 *with* Retry-After is overload, counted apart and not a failure.
- disconnect: none expected (the client closes after sending, after a short delay, or after the first
  bytes of a stream); if an answer does arrive first it must not be a 5xx.
- oversized: 400 or 413 (too many tokens, too many inputs, a body over server.max_body_bytes).
- malformed: any 4xx (bad JSON, wrong types, unknown fields, wrong method or path, bad headers).
- deadline: 200 or 504 (header x-carpool-timeout between 0.05 and 0.5 s).
Every request must be answered within its deadline + 1 s (the server's default timeout when it names
none): a request without an answer by then is HUNG. A connection dropped without an answer is a
failure too (except for the disconnect class, which drops it itself).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from bench.loadgen import percentile

GRACE_S = 1.0
"""A request must be answered within its deadline plus this."""
TIMEOUT_HEADER = "x-carpool-timeout"
RSS_GROWTH_BAR = 0.05


class Kind(StrEnum):
    NORMAL = "normal"
    DISCONNECT = "disconnect"
    OVERSIZED = "oversized"
    MALFORMED = "malformed"
    DEADLINE = "deadline"


DEFAULT_MIX: dict[Kind, float] = {
    Kind.NORMAL: 0.70,
    Kind.DISCONNECT: 0.08,
    Kind.OVERSIZED: 0.06,
    Kind.MALFORMED: 0.08,
    Kind.DEADLINE: 0.08,
}
MODEL_KINDS = (Kind.NORMAL, Kind.DISCONNECT, Kind.DEADLINE)
"""Classes whose requests reach the model (the load is set on these)."""


class Verdict(StrEnum):
    OK = "ok"
    OVERLOAD = "overload"
    """429/503 with Retry-After: the server shed load as it should."""
    DISCONNECTED = "disconnected"
    HUNG = "hung"
    NO_ANSWER = "no answer"
    """The connection closed or failed before a status line."""
    SERVER_ERROR = "5xx"
    WRONG_STATUS = "wrong status"
    BROKEN_STREAM = "broken stream"
    """A 200 event stream that carried an error event or ended without `data: [DONE]`."""

    @property
    def failed(self) -> bool:
        return self not in (Verdict.OK, Verdict.OVERLOAD, Verdict.DISCONNECTED)


class Disconnect(StrEnum):
    AFTER_SEND = "after_send"
    AFTER_DELAY = "after_delay"
    AFTER_FIRST_BYTES = "after_first_bytes"


@dataclass(frozen=True)
class Limits:
    """What the server under test accepts (read from it, or from the flags it was started with)."""

    model: str
    max_input_tokens: int
    max_items: int
    max_body_bytes: int
    default_timeout_s: float
    generation: bool = False


@dataclass(frozen=True)
class Probe:
    """One planned request: the whole HTTP request as bytes and what may come back."""

    kind: Kind
    variant: str
    data: bytes
    allowed: frozenset[int]
    budget_s: float
    """The answer must arrive within this many seconds of sending (deadline + GRACE_S)."""
    disconnect: Disconnect | None = None
    disconnect_after_s: float = 0.0
    streaming: bool = False
    expect_continue: bool = False
    """Send the head with `Expect: 100-continue` and the body only once the server asks for it."""
    reusable: bool = True
    """Whether it may go on a kept-alive connection (not when the client drops it, nor bodies the server
    refuses before reading them)."""


@dataclass(frozen=True)
class Answer:
    """What came back: `status` None when nothing did (`hung` says whether the budget ran out)."""

    status: int | None
    latency_s: float
    retry_after: bool = False
    body: bytes = b""
    hung: bool = False
    disconnected: bool = False


def _request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    content_type: str = "application/json",
    chunked: bool = False,
    expect: bool = False,
) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    if expect:
        head += "Expect: 100-continue\r\n"
    for name, value in (headers or {}).items():
        head += f"{name}: {value}\r\n"
    if chunked:
        head += f"Content-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n"
        size = 1 << 16
        parts = [
            b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)
        ]
        return head.encode("latin-1") + b"".join(parts) + b"0\r\n\r\n"
    if body or method in ("POST", "PUT"):
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode("latin-1") + body


def _words(rng: random.Random, count: int) -> str:
    from bench.corpus import WORDS

    return " ".join(rng.choice(WORDS) for _ in range(count))


TOPICS = ("a lighthouse", "a robot painter", "two rival bakers", "a winter storm", "a quiet moon", "a fox")


class TrafficBuilder:
    """Builds requests of each class for one server; every choice comes from the `rng` it is given."""

    def __init__(self, limits: Limits, host: str, port: int, texts: Sequence[str]) -> None:
        self.limits = limits
        self.host = host
        self.port = port
        self.texts = texts
        self.path = "/v1/completions" if limits.generation else "/v1/embeddings"
        self.normal_budget = limits.default_timeout_s + GRACE_S

    def _post(self, body: Any, headers: Mapping[str, str] | None = None) -> bytes:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return _request(self.host, self.port, "POST", self.path, raw, headers)

    def _normal_body(self, rng: random.Random) -> tuple[dict[str, Any], bool]:
        if not self.limits.generation:
            if rng.random() < 0.2:
                return {"input": [rng.choice(self.texts) for _ in range(rng.randint(2, 8))]}, False
            return {"input": rng.choice(self.texts)}, False
        streaming = rng.random() < 0.5
        prompt = f"Write a short story about {rng.choice(TOPICS)}. {_words(rng, rng.randint(0, 40))}"
        body = {"prompt": prompt, "max_tokens": rng.randint(4, 24), "temperature": 0.0, "stream": streaming}
        return body, streaming

    def build(self, kind: Kind, rng: random.Random) -> Probe:
        return getattr(self, f"_{kind.value}")(rng)  # type: ignore[no-any-return]

    def _normal(self, rng: random.Random) -> Probe:
        body, streaming = self._normal_body(rng)
        return Probe(
            Kind.NORMAL,
            "stream" if streaming else "plain",
            self._post(body),
            frozenset({200}),
            self.normal_budget,
            streaming=streaming,
        )

    def _deadline(self, rng: random.Random) -> Probe:
        body, streaming = self._normal_body(rng)
        deadline = round(rng.uniform(0.05, 0.5), 3)
        data = self._post(body, {TIMEOUT_HEADER: str(deadline)})
        return Probe(
            Kind.DEADLINE,
            f"{deadline:.2f}s",
            data,
            frozenset({200, 504}),
            deadline + GRACE_S,
            streaming=streaming,
        )

    def _disconnect(self, rng: random.Random) -> Probe:
        body, streaming = self._normal_body(rng)
        modes = [Disconnect.AFTER_SEND, Disconnect.AFTER_DELAY]
        if self.limits.generation:
            body["stream"] = streaming = True
            modes.append(Disconnect.AFTER_FIRST_BYTES)
        mode = rng.choice(modes)
        after = round(rng.uniform(0.001, 0.2), 4) if mode is Disconnect.AFTER_DELAY else 0.0
        return Probe(
            Kind.DISCONNECT,
            mode.value,
            self._post(body),
            frozenset({200}),
            self.normal_budget,
            disconnect=mode,
            disconnect_after_s=after,
            streaming=streaming,
            reusable=False,
        )

    def _oversized(self, rng: random.Random) -> Probe:
        limits = self.limits
        field_name = "prompt" if limits.generation else "input"
        variants = [
            "tokens_over_limit",
            "huge_text",
            "too_many_inputs",
            "body_over_limit",
            "body_over_limit_expect",
            "chunked_over_limit",
        ]
        if limits.generation:
            variants.append("max_tokens_over_context")
        variant = rng.choice(variants)
        if variant == "tokens_over_limit":
            # About two tokens per word for the small models here: well past the limit, yet short enough
            # in characters to be tokenized rather than refused by a length guard.
            body: Any = {field_name: _words(rng, limits.max_input_tokens + 64)}
        elif variant == "huge_text":
            body = {field_name: "x" * (100 * limits.max_input_tokens)}
        elif variant == "too_many_inputs":
            count = 2 if limits.generation else limits.max_items + 1
            body = {field_name: ["hello there"] * count}
        elif variant == "max_tokens_over_context":
            body = {"prompt": "Tell me a story.", "max_tokens": 2 * limits.max_input_tokens}
        else:
            filler = "a " * (limits.max_body_bytes // 2 + 1024)
            raw = json.dumps({field_name: filler}).encode()
            chunked = variant == "chunked_over_limit"
            expect = variant == "body_over_limit_expect"
            data = _request(self.host, self.port, "POST", self.path, raw, chunked=chunked, expect=expect)
            return Probe(
                Kind.OVERSIZED,
                variant,
                data,
                frozenset({400, 413}),
                self.normal_budget,
                expect_continue=expect,
                reusable=False,
            )
        return Probe(
            Kind.OVERSIZED,
            variant,
            self._post(body),
            frozenset({400, 413}),
            self.normal_budget,
        )

    def _malformed(self, rng: random.Random) -> Probe:
        field_name = "prompt" if self.limits.generation else "input"
        host, port, path = self.host, self.port, self.path
        variant = rng.choice(
            [
                "bad_json",
                "wrong_type",
                "unknown_field",
                "bad_value",
                "not_utf8",
                "empty_body",
                "bad_timeout_header",
                "wrong_method",
                "unknown_path",
                "wrong_content_type",
            ]
        )
        allowed = frozenset(range(400, 500))
        if variant == "bad_json":
            data = self._post(f'{{"{field_name}": "unterminated'.encode())
        elif variant == "wrong_type":
            data = self._post({field_name: rng.choice([5, None, {"text": "x"}, [1, 2], True])})
        elif variant == "unknown_field":
            data = self._post({field_name: "hello", "no_such_field": 1})
        elif variant == "bad_value":
            bad = (
                {"prompt": "hello", "max_tokens": 0}
                if self.limits.generation
                else {"input": rng.choice(["", []])}
            )
            data = self._post(bad)
        elif variant == "not_utf8":
            data = self._post(b'{"' + field_name.encode() + b'": "\xff\xfe\xfd"}')
        elif variant == "empty_body":
            data = self._post(b"")
        elif variant == "bad_timeout_header":
            data = self._post({field_name: "hello"}, {TIMEOUT_HEADER: "soon"})
        elif variant == "wrong_method":
            data = _request(host, port, "GET", path)
        elif variant == "unknown_path":
            data = _request(host, port, "POST", "/v1/no-such-route", b'{"input": "x"}')
        else:
            # Valid JSON sent as text/plain: a server may refuse it (4xx) or read it anyway (200).
            body = json.dumps({field_name: "hello", **({"max_tokens": 4} if self.limits.generation else {})})
            data = _request(host, port, "POST", path, body.encode(), content_type="text/plain")
            allowed = allowed | {200}
        return Probe(Kind.MALFORMED, variant, data, allowed, self.normal_budget)


def plan_kinds(rng: random.Random, count: int, mix: Mapping[Kind, float]) -> list[Kind]:
    """`count` classes drawn independently with the `mix` weights (seeded by `rng`)."""
    kinds = list(mix)
    weights = [mix[k] for k in kinds]
    if count < 0 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"need a non-negative count and mix weights with a positive sum, got {dict(mix)}")
    return rng.choices(kinds, weights, k=count)


def plan_traffic(builder: TrafficBuilder, count: int, seed: int, mix: Mapping[Kind, float]) -> list[Probe]:
    rng = random.Random(seed)
    return [builder.build(kind, rng) for kind in plan_kinds(rng, count, mix)]


def arrival_rate(saturation_per_s: float, load: float, mix: Mapping[Kind, float]) -> float:
    """Total arrival rate such that the classes that reach the model arrive at `load` x saturation (the
    refused classes cost the server little, so counting them would leave the model underloaded)."""
    total = sum(mix.values())
    model_share = sum(mix.get(k, 0.0) for k in MODEL_KINDS) / total
    if model_share <= 0:
        return load * saturation_per_s
    return load * saturation_per_s / model_share


def classify(probe: Probe, answer: Answer) -> Verdict:
    """The verdict on one answer, by the rules in the module docstring."""
    if answer.hung:
        return Verdict.HUNG
    status = answer.status
    if status is None:
        return Verdict.DISCONNECTED if answer.disconnected else Verdict.NO_ANSWER
    if status in (429, 503) and answer.retry_after:
        return Verdict.OVERLOAD
    if status >= 500 and status not in probe.allowed:
        return Verdict.SERVER_ERROR
    if status not in probe.allowed:
        return Verdict.WRONG_STATUS
    if answer.disconnected:
        return Verdict.DISCONNECTED
    # A deadline may end a running stream with an error event; any other error event is a failure.
    errors_allowed = probe.kind is Kind.DEADLINE
    if status == 200 and probe.streaming and not stream_complete(answer.body, errors_allowed):
        return Verdict.BROKEN_STREAM
    return Verdict.OK


def stream_complete(body: bytes, errors_allowed: bool = False) -> bool:
    """An event stream that ends with `data: [DONE]` and (unless `errors_allowed`) has no error event."""
    events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    if not events or events[-1].strip() != b"[DONE]":
        return False
    return errors_allowed or not any(event.startswith(b'{"error"') for event in events)


# -- RSS ----------------------------------------------------------------------------------------------


def window_mean(samples: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Mean of the values whose time lies in [start, end) (times relative to the first sample's run)."""
    values = [value for at, value in samples if start <= at < end]
    return sum(values) / len(values) if values else math.nan


def rss_growth(samples: Sequence[tuple[float, float]], duration_s: float) -> float:
    """(mean of the last 10% − mean of the 20-30% window) / the latter, from (seconds since the start
    of the run, bytes) samples. The first 20% is warm-up (allocator pools, caches filling)."""
    base = window_mean(samples, 0.2 * duration_s, 0.3 * duration_s)
    tail = window_mean(samples, 0.9 * duration_s, math.inf)
    if math.isnan(base) or math.isnan(tail) or base <= 0:
        return math.nan
    return (tail - base) / base


# -- report -------------------------------------------------------------------------------------------


@dataclass
class ClassStats:
    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    verdicts: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "statuses": dict(sorted(self.statuses.items())),
            "verdicts": dict(sorted(self.verdicts.items())),
            "p50_ms": percentile(self.latencies, 50) * 1e3,
            "p99_ms": percentile(self.latencies, 99) * 1e3,
            "hung": self.verdicts[Verdict.HUNG.value],
        }


def tally(results: Sequence[tuple[Probe, Answer, Verdict]]) -> dict[str, ClassStats]:
    stats: dict[str, ClassStats] = {kind.value: ClassStats() for kind in Kind}
    for probe, answer, verdict in results:
        row = stats[probe.kind.value]
        row.sent += 1
        label = "none" if answer.status is None else str(answer.status)
        if answer.hung:
            label = "hung"
        elif answer.disconnected and answer.status is None:
            label = "dropped"
        row.statuses[label] += 1
        row.verdicts[verdict.value] += 1
        if answer.status is not None and not answer.hung:
            row.latencies.append(answer.latency_s)
    return stats


def _ms(seconds_ms: float) -> str:
    return "n/a" if math.isnan(seconds_ms) else f"{seconds_ms:,.1f}"


def table(stats: Mapping[str, ClassStats]) -> str:
    lines = [
        "| class | sent | statuses | p50 ms | p99 ms | overload | hung | failures |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in stats.items():
        summary = row.summary()
        statuses = ", ".join(f"{code}: {n}" for code, n in summary["statuses"].items()) or "-"
        failures = sum(n for v, n in row.verdicts.items() if Verdict(v).failed)
        lines.append(
            f"| {name} | {row.sent} | {statuses} | {_ms(summary['p50_ms'])} | {_ms(summary['p99_ms'])} | "
            f"{row.verdicts[Verdict.OVERLOAD.value]} | {summary['hung']} | {failures} |"
        )
    return "\n".join(lines)
