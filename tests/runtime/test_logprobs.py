"""Logprobs on carpool's own engine: what the engine computes (against a reference forward pass of the same
weights) and what the OpenAI fronts make of it (vLLM's shapes, streaming, stop strings, refusals).

A tiny random Llama (`lora_helpers.tiny_generator`, MiniLM's tokenizer plus a chat template written here)
is served by the real engine and front over loopback HTTP: its text is gibberish, but greedy decoding is
deterministic, and that is all these tests need. vLLM's own server is the reference in tests/vllm.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from carpool.runtime.api.frontend import Delta, Frontend, Generation
from carpool.runtime.api.text import TextCodec
from carpool.runtime.batching.continuous import (
    BlockAllocator,
    IterationPolicy,
    IterationScheduler,
    Sequence,
)
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.config import DType, GenerationConfig, ModelConfig, Task
from carpool.runtime.engine.process import load_engine
from carpool.runtime.errors import BatchFailed
from carpool.runtime.models.generation import GenerationEngine
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.sources import resolve_source
from carpool.runtime.wire import GenerateRequest, TokenLogprobs, TokenOutput
from tests.runtime.conftest import Running, serve
from tests.runtime.factories import runtime_config, streamed_logprobs
from tests.runtime.fakes import ScriptedGenerator, token_of
from tests.runtime.lora_helpers import tiny_generator

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over the lazy dog"
TOKENS = 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tiny_generator(tmp_path_factory.mktemp("tiny-llama"), seed=3)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tiny(folder: Path) -> Iterator[Running]:
    config = runtime_config(
        model={"source": str(folder), "task": "generate", "dtype": "float32", "name": "tiny"},
        generation={"max_model_len": 128, "kv_cache_tokens": 1024, "max_logprobs": 5},
        warmup={"enabled": False},
    )
    with serve(config, load_engine) as running:
        yield running


def reference(
    folder: Path, prompt: list[int], tokens: int, output: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Greedy ids after `prompt` (or the given `output`) and the log-softmax of each position's logits, by
    a plain transformers forward pass over the whole sequence (no cache, no carpool)."""
    model: Any = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        if output is not None:
            ids += output
        else:
            for _ in range(tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
        logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1]
    return ids[len(prompt) :], logits.float().log_softmax(-1)


def post(server: Running, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = server.client.post(path, json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def stream(server: Running, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with server.client.stream("POST", path, json=payload) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# -- the engine --------------------------------------------------------------------------------------


def test_the_engine_returns_the_raw_distributions_logprobs_and_computes_none_unasked(folder: Path) -> None:
    config = ModelConfig(source=str(folder), task=Task.GENERATE, dtype=DType.FLOAT32)
    engine = GenerationEngine(
        resolve_source(str(folder)),
        config,
        GenerationConfig(kv_cache_tokens=512, max_model_len=128, kv_block_size=4),
        "tiny",
        torch.device("cpu"),
        torch.float32,
    )
    scheduler = IterationScheduler(
        IterationPolicy(max_running_sequences=4, max_step_tokens=64),
        RequestQueue(8, 1),
        BlockAllocator(engine.num_blocks, engine.block_size),
    )
    prompt = engine.encode(PROMPT)
    asked, plain, hot = (
        Sequence(tokens=list(prompt), arrival=0.0, deadline=math.inf, max_tokens=TOKENS) for _ in range(3)
    )
    # Greedy with 4 alternatives; the same prompt without logprobs; sampled hot (temperature 1.5, top-k 3):
    # its logprobs are still the raw distribution's (vLLM's default raw_logprobs).
    params = {
        asked.seq: SamplingParams(temperature=0.0, logprobs=4),
        plain.seq: SamplingParams(temperature=0.0),
        hot.seq: SamplingParams(temperature=1.5, top_k=3, seed=7, logprobs=0),
    }
    for seq in (asked, plain, hot):
        scheduler.submit(seq, 0.0)
    rows: dict[int, list[tuple[list[int], list[float]]]] = {asked.seq: [], hot.seq: []}
    while scheduler.running or scheduler.waiting:
        plan = scheduler.schedule(0.0)
        sampled = engine.step(plan, params)
        assert plain.seq not in engine.logprobs
        for sid, logprobs in engine.logprobs.items():
            id_rows, value_rows = logprobs.arrays()
            assert id_rows.shape == (1, (params[sid].logprobs or 0) + 1)
            assert id_rows[0, 0] == sampled[sid]
            rows[sid].append((id_rows[0].tolist(), value_rows[0].tolist()))
        scheduler.complete(plan, sampled, 0.0)
        for seq in list(scheduler.running):
            if len(seq.output) >= seq.max_tokens:
                scheduler.finish(seq)
    expected_ids, expected = reference(folder, prompt, TOKENS)
    assert asked.output == plain.output == expected_ids
    for position, (ids, values) in enumerate(rows[asked.seq]):
        top = expected[position].topk(4)
        assert ids[1:] == top.indices.tolist()  # most likely first
        assert ids[0] == ids[1]  # greedy: the sampled token is the most likely
        assert values[1:] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert values[1:] == sorted(values[1:], reverse=True)
        assert values[0] == pytest.approx(expected[position, ids[0]].item(), abs=1e-4)
    # The hot sequence: the log-softmax of the unscaled logits at its own tokens.
    _, hot_reference = reference(folder, prompt, TOKENS, hot.output)
    assert len(rows[hot.seq]) == TOKENS
    for position, (ids, values) in enumerate(rows[hot.seq]):
        assert ids == [hot.output[position]]
        assert values[0] == pytest.approx(hot_reference[position, ids[0]].item(), abs=1e-4)


# -- the fronts --------------------------------------------------------------------------------------


def test_completions_logprobs_are_the_engines_in_vllms_shape(tiny: Running, folder: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "logprobs": 2}
    answer = post(tiny, "/v1/completions", body)
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    prompt = tokenizer.encode(PROMPT).ids
    ids, expected = reference(folder, prompt, TOKENS)
    assert answer["usage"]["completion_tokens"] == TOKENS == len(logprobs["tokens"])
    # Each token's text is the decode of its id alone, special tokens kept (vLLM's server).
    assert logprobs["tokens"] == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert logprobs["token_logprobs"] == pytest.approx(
        [expected[k, i].item() for k, i in enumerate(ids)], abs=1e-4
    )
    offsets = [sum(len(t) for t in logprobs["tokens"][:k]) for k in range(TOKENS)]
    assert logprobs["text_offset"] == offsets
    for k, top in enumerate(logprobs["top_logprobs"]):
        # logprobs 2: the sampled token and the 2 most likely (the sampled one is the first of them)
        best = expected[k].topk(2)
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in best.indices.tolist()]
        assert list(top) == list(dict.fromkeys(texts))
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert top[logprobs["tokens"][k]] == logprobs["token_logprobs"][k]
    # logprobs 0: the sampled token's alone. Sampled hot from this near-uniform model, the token is not
    # among the 2 most likely: it comes first, then those 2 (N+1 entries, vLLM's order).
    zero = post(tiny, "/v1/completions", {**body, "logprobs": 0})["choices"][0]["logprobs"]
    assert [list(top) for top in zero["top_logprobs"]] == [[token] for token in zero["tokens"]]
    hot = post(tiny, "/v1/completions", {**body, "temperature": 2.0, "seed": 5})["choices"][0]["logprobs"]
    for token, value, top in zip(hot["tokens"], hot["token_logprobs"], hot["top_logprobs"], strict=True):
        assert len(top) == 3 and next(iter(top)) == token and top[token] == value
        assert value < min(list(top.values())[1:])
    # Without logprobs: null, as before.
    plain = post(tiny, "/v1/completions", {**body, "logprobs": None})
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["text"] == choice["text"]
    assert post(tiny, "/v1/completions", {**body, "logprobs": False})["choices"][0]["logprobs"] is None


def test_streamed_logprobs_add_up_to_the_whole_answers_also_at_a_stop_string(tiny: Running) -> None:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "logprobs": 1}
    whole = post(tiny, "/v1/completions", body)
    logprobs = whole["choices"][0]["logprobs"]
    chunks = stream(tiny, "/v1/completions", body)
    assert streamed_logprobs(chunks[:-1]) == logprobs
    assert chunks[-1]["usage"]["completion_tokens"] == len(logprobs["tokens"]) == TOKENS
    # A stop string that starts inside the 5th token's text and ends in the 6th's: the answer ends with the
    # 6th token (the one that completed it), as vLLM's; the held-back text never loses a token's logprobs.
    tokens, text = logprobs["tokens"], whole["choices"][0]["text"]
    end = 0
    words = [token.removeprefix("##") for token in tokens]  # WordPiece: the text spaces words, joins ##s
    for word in words[:5]:  # where the 5th token's text ends in the text
        end = text.index(word, end) + len(word)
    stop = text[end - 1 : end + 2]
    at = text.find(stop)
    assert at == end - 1 and text[end:].lstrip().startswith(words[5][:1]), (text, stop)
    for answer in (post(tiny, "/v1/completions", {**body, "stop": stop}),):
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["text"] == text[:at]
        kept = choice["logprobs"]
        assert answer["usage"]["completion_tokens"] == len(kept["tokens"])
        assert kept == {key: value[: len(kept["tokens"])] for key, value in logprobs.items()}
        assert len(kept["tokens"]) == 6
    chunks = stream(tiny, "/v1/completions", {**body, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == text[:at]
    assert streamed_logprobs(chunks[:-1]) == kept
    assert chunks[-1]["usage"]["completion_tokens"] == len(kept["tokens"])
    # A long stop string that never comes holds the text back (19 characters): the chunks carry each
    # token's logprobs at once, before (without) its text, and add up to the same.
    chunks = stream(tiny, "/v1/completions", {**body, "stop": "z" * 20})
    assert any(c["choices"][0]["logprobs"]["tokens"] and not c["choices"][0]["text"] for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == text
    assert streamed_logprobs(chunks[:-1]) == logprobs


def test_chat_logprobs_and_top_logprobs_streamed_and_whole(tiny: Running) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    answer = post(tiny, "/v1/chat/completions", body)
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] == 6
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode())
        tops = item["top_logprobs"]
        assert len(tops) == 3
        assert tops[0]["token"] == item["token"] and tops[0]["logprob"] == item["logprob"]  # greedy
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert all(t["bytes"] == list(t["token"].encode()) for t in tops)
    chunks = stream(tiny, "/v1/chat/completions", body)
    streamed = [item for c in chunks[1:-1] for item in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role's opening chunk
    # logprobs alone: each token's, no alternatives
    alone = post(tiny, "/v1/chat/completions", {**body, "top_logprobs": None})
    assert [i["token"] for i in alone["choices"][0]["logprobs"]["content"]] == [i["token"] for i in content]
    assert all(i["top_logprobs"] == [] for i in alone["choices"][0]["logprobs"]["content"])
    off = post(tiny, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": 0})
    assert off["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": "2"}, "logprobs"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),  # over generation.max_logprobs (5 here)
        ("/v1/completions", {"logprobs": 2, "echo": True}, "echo"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ],
)
def test_bad_logprobs_are_refused_with_400_naming_the_field(
    tiny: Running, path: str, fields: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = (
        {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    response = tiny.client.post(path, json={**base, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"]
    if fields.get("logprobs") is True and path == "/v1/completions":
        assert "the number of most likely tokens" in error["message"]  # not a bare type error


def test_v2_inference_refuses_logprobs_rather_than_ignoring_them(tiny: Running) -> None:
    body = {
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}],
        "parameters": {"max_tokens": 2, "logprobs": 2},
    }
    response = tiny.client.post("/v2/models/tiny/infer", json=body)
    assert response.status_code == 400, response.text
    assert "parameters.logprobs" in response.json()["error"]


# -- several tokens in one message -------------------------------------------------------------------


class Scripted:
    """An engine client that answers a generation with the given messages. vLLM sends several tokens of a
    sequence in one message under speculative decoding, which this machine cannot run: this stands in."""

    def __init__(self, outputs: list[TokenOutput]) -> None:
        self.outputs = outputs
        self.front = 0

    def next_rid(self) -> int:
        return 1

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenOutput, None]:
        for output in self.outputs:
            yield output


def test_a_stop_string_inside_a_message_of_several_tokens_keeps_the_tokens_up_to_it() -> None:
    words = ["t1", "t2", "t3", "t4", "t5"]
    ids = [token_of(word) for word in words]
    rows = np.array([[i, i] for i in ids])
    values = -np.arange(1.0, 11.0).reshape(5, 2)
    message = TokenOutput(1, ids[:4], None, TokenLogprobs.of(rows[:4], values[:4]))
    last = TokenOutput(1, ids[4:], "length", TokenLogprobs.of(rows[4:], values[4:]))
    codec = TextCodec(ScriptedGenerator().text_spec())
    service = Frontend(runtime_config(model={"task": "generate"}), Scripted([message, last]))  # type: ignore[arg-type]

    def run(stop: tuple[str, ...]) -> tuple[list[Delta], Generation]:
        request = GenerateRequest(1, 0, [1], SamplingParams(stop=stop, logprobs=1), 0, 0.0, 1e9)
        generation = Generation(1)
        service._enter()

        async def follow() -> list[Delta]:
            return [delta async for delta in service._follow(request, generation, codec)]

        return asyncio.run(follow()), generation

    deltas, generation = run(("t2 t3",))  # completed by the 3rd token of the first message
    assert "".join(d.text for d in deltas) == "t1 "
    assert deltas[-1].finish_reason == "stop"
    assert [e.token for d in deltas for e in d.logprobs or []] == words[:3]
    assert [e.logprob for d in deltas for e in d.logprobs or []] == [-1.0, -3.0, -5.0]
    assert generation.completion_tokens == 3
    deltas, generation = run(())
    assert [e.token for d in deltas for e in d.logprobs or []] == words
    assert generation.completion_tokens == 5


def test_tokens_without_the_logprobs_asked_for_fail_the_request_rather_than_answer_without() -> None:
    codec = TextCodec(ScriptedGenerator().text_spec())
    bare = TokenOutput(1, [token_of("t1")], "length")
    service = Frontend(runtime_config(model={"task": "generate"}), Scripted([bare]))  # type: ignore[arg-type]
    request = GenerateRequest(1, 0, [1], SamplingParams(logprobs=0), 0, 0.0, 1e9)
    service._enter()

    async def follow() -> list[Delta]:
        return [delta async for delta in service._follow(request, Generation(1), codec)]

    with pytest.raises(BatchFailed, match="without the logprobs"):
        asyncio.run(follow())
