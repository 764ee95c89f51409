"""The OpenAI surface of a model on carpool's own engine, beyond plain text: the model's generation-config
defaults where a request is silent, content parts, a message's `name`, `/tokenize` and `/detokenize` in
vLLM's shapes, and what it cannot do refused by name (a model on vLLM's engine answers all of vLLM's
surface: tests/vllm/test_surface.py). On a tiny random Llama (gibberish, but deterministic) whose
`generation_config.json` says `top_k: 1` (greedy)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from carpool.runtime.engine.process import load_engine
from tests.runtime.conftest import Running, serve, stream_then_leave, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedGenerator, factory
from tests.runtime.lora_helpers import tiny_generator

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}{% if m['name'] %} ({{ m['name'] }}){% endif %}: "
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tiny_generator(tmp_path_factory.mktemp("tiny-llama"), seed=3)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "top_k": 1}))
    return folder


@pytest.fixture(scope="module")
def tiny(folder: Path) -> Iterator[Running]:
    config = runtime_config(
        model={"source": str(folder), "task": "generate", "dtype": "float32", "name": "tiny"},
        generation={"max_model_len": 128, "kv_cache_tokens": 1024},
        warmup={"enabled": False},
    )
    with serve(config, load_engine) as running:
        yield running


def post(server: Running, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    response = server.client.post(path, json=body)
    assert response.status_code == status, response.text
    answer: dict[str, Any] = response.json()
    return answer


def text(server: Running, **body: Any) -> str:
    answer = post(server, "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 10, **body})
    return str(answer["choices"][0]["text"])


def test_the_models_generation_config_applies_where_a_request_is_silent(tiny: Running) -> None:
    greedy = text(tiny, temperature=1.0, top_k=1)
    # Silent on top_k: the model's own `top_k: 1`, whatever the seed (as vLLM's server applies it).
    assert text(tiny, seed=1) == text(tiny, seed=2) == greedy
    # Said otherwise: the request wins (top_k 0, no filter: a random model's near-uniform distribution).
    assert text(tiny, top_k=0, seed=1) != greedy


def test_content_parts_of_type_text_and_a_messages_name_reach_the_chat_template(tiny: Running) -> None:
    def chat(content: Any, **message: Any) -> dict[str, Any]:
        messages = [{"role": "user", "content": content, **message}]
        return post(tiny, "/v1/chat/completions", {"messages": messages, "max_tokens": 6})

    whole = chat("hello\nworld")
    parts = chat([{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}])
    assert parts["choices"][0]["message"] == whole["choices"][0]["message"]
    assert parts["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    named = chat("hello\nworld", name="ada")
    assert named["usage"]["prompt_tokens"] > whole["usage"]["prompt_tokens"]  # "user (ada): ..."


def test_tokenize_and_detokenize_in_vllms_shapes_with_the_models_tokenizer(
    tiny: Running, folder: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt = "the quick brown fox"
    answer = post(tiny, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    ids = tokenizer(prompt)["input_ids"]
    assert answer == {
        "count": len(ids),
        "max_model_len": 128,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    messages = [{"role": "user", "content": "hi"}]
    chat = post(tiny, "/tokenize", {"messages": messages})
    rendered: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(rendered if isinstance(rendered, list) else rendered["input_ids"])
    assert post(tiny, "/detokenize", {"tokens": ids}) == {"prompt": tokenizer.decode(ids)}
    refused = post(tiny, "/detokenize", {"tokens": [10**9]}, status=400)
    assert "tokens" in refused["error"]["message"]


def tokens(server: Running, **body: Any) -> list[str]:
    answer = post(
        server, "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 12, "logprobs": 0, **body}
    )
    return list(answer["choices"][0]["logprobs"]["tokens"])


def test_penalties_min_tokens_and_stop_token_ids_reach_carpools_sampler(tiny: Running, folder: Path) -> None:
    """vLLM's sampling fields on carpool's own engine. A random model's logits are nearly flat: a
    negative presence or frequency penalty (a reward) larger than their spread makes the first token
    win every later step; a stop token ends the answer before it, unless min_tokens."""
    plain = tokens(tiny)
    assert len(set(plain)) == 12  # greedy on this random model never repeats in 12 tokens
    for field in ("presence_penalty", "frequency_penalty"):
        rewarded = tokens(tiny, **{field: -2.0})
        assert rewarded == [rewarded[0]] * 12, (field, rewarded)
    assert tokens(tiny, repetition_penalty=0.01) != plain  # below 1 it favours the prompt's tokens
    # The ids whose text is the plain answer's third token's (logprobs give texts, not ids).
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    word = plain[2].strip()
    assert word
    ids = [i for i in range(len(tokenizer)) if str(tokenizer.decode([i])).strip() == word]
    assert 0 < len(ids) <= 64
    body = {"prompt": "the quick brown fox", "max_tokens": 12, "stop_token_ids": ids}
    stopped = post(tiny, "/v1/completions", body)
    first = [t.strip() for t in plain].index(word)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == first  # the stop token is not part of the answer
    held = tokens(tiny, stop_token_ids=ids, min_tokens=12)
    assert len(held) == 12 and word not in [t.strip() for t in held]  # held back until the 12th token
    too_few = post(tiny, "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, status=400)
    assert "min_tokens" in too_few["error"]["message"]
    for field, value in (("presence_penalty", 2.5), ("repetition_penalty", 0.0)):
        answer = post(tiny, "/v1/completions", {"prompt": "x", field: value}, status=400)
        assert field in answer["error"]["message"]


def _refused_naming(tiny: Running, path: str, field: str, value: Any) -> None:
    """`field: value` on the smallest request of `path` is a 400 whose message names the field."""
    base = (
        {"prompt": "hi"}
        if path != "/v1/chat/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    answer = post(tiny, path, {**base, field: value}, status=400)
    assert field in answer["error"]["message"]


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "response_format", {"type": "json_object"}),
        ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/completions", "best_of", 2),  # gone from vLLM's server: unknown here, as any other field
        ("/tokenize", "tools", []),
    ],
)
def test_what_carpools_engine_cannot_do_is_refused_naming_the_field(
    tiny: Running, path: str, field: str, value: Any
) -> None:
    _refused_naming(tiny, path, field, value)


def test_kserve_v2_generation_takes_the_same_defaults_and_refuses_what_it_does_not_offer(
    tiny: Running,
) -> None:
    def v2(status: int = 200, **parameters: Any) -> dict[str, Any]:
        inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["the quick brown fox"]}]
        body = {"inputs": inputs, "parameters": {"max_tokens": 10, **parameters}}
        return post(tiny, "/v2/models/tiny/infer", body, status)

    assert v2(seed=1)["outputs"][0]["data"] == v2(seed=2)["outputs"][0]["data"] == [text(tiny, top_k=1)]
    assert v2(min_p=1.0, temperature=1.0, top_k=0, seed=1)["outputs"][0]["data"] == [text(tiny, top_k=1)]
    for key, value in (("logit_bias", {"5": 1.0}), ("n", 2), ("min_p", 1.5)):
        refused = v2(400, **{key: value})
        assert f"parameters.{key}" in refused["error"] or key in refused["error"], refused


# -- logit_bias, min_p and n (issue 43) ------------------------------------------------------------------


def test_a_large_logit_bias_makes_greedy_emit_its_token_every_step(tiny: Running, folder: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    fox = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"][-1]
    body = {"prompt": "the quick brown fox", "max_tokens": 12, "logprobs": 0, "logit_bias": {str(fox): 100}}
    answer = post(tiny, "/v1/completions", body)
    choice = answer["choices"][0]
    assert choice["text"].strip() and choice["text"] == tokenizer.decode([fox] * 12)
    assert answer["usage"]["completion_tokens"] == 12
    # The logprobs stay the raw distribution's (vLLM's default): a random model's near-uniform one, not
    # the biased one (where the token would be certain, logprob 0).
    assert all(logprob < -1.0 for logprob in choice["logprobs"]["token_logprobs"])
    assert len(set(tokens(tiny))) == 12  # unbiased, greedy never repeats a token on this model


def test_min_p_of_one_under_temperature_is_greedy(tiny: Running) -> None:
    greedy = text(tiny, top_k=1)
    sampled = [text(tiny, temperature=1.0, top_k=0, seed=seed) for seed in (1, 2)]
    assert greedy not in sampled  # no filter: a random model's near-uniform distribution
    assert [text(tiny, temperature=1.0, top_k=0, min_p=1.0, seed=seed) for seed in (1, 2)] == [greedy] * 2


def test_n_greedy_choices_are_identical_and_their_usage_adds_up(tiny: Running) -> None:
    one = post(tiny, "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 10})
    three = post(tiny, "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 10, "n": 3})
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert [c["text"] for c in three["choices"]] == [one["choices"][0]["text"]] * 3
    usage = one["usage"]
    assert three["usage"] == {
        "prompt_tokens": usage["prompt_tokens"],  # the prompt once, as vLLM counts it
        "completion_tokens": 3 * usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + 3 * usage["completion_tokens"],
    }
    messages = [{"role": "user", "content": "hello"}]
    chat = post(tiny, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "n": 3})
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in chat["choices"]}) == 1
    # Greedy by temperature 0 with n > 1 is refused, as vLLM's SamplingParams refuses it (greedy by
    # top_k 1, as above, is not).
    for path, base in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": messages}),
    ):
        refused = post(tiny, path, {**base, "n": 2, "temperature": 0}, status=400)
        assert "n" in refused["error"]["message"] and "greedy" in refused["error"]["message"]


def events(server: Running, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = server.client.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_n_streamed_chunks_carry_each_choices_index_and_add_up_to_the_answer(tiny: Running) -> None:
    body = {
        "prompt": "the quick brown fox",
        "max_tokens": 10,
        "n": 2,
        "temperature": 1.0,
        "top_k": 0,
        "seed": 7,
        "logprobs": 1,
    }
    whole = post(tiny, "/v1/completions", body)
    chunks = events(tiny, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert texts[0] != texts[1]  # independent samples
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    # Choice i samples with seed + i (vLLM's ParentRequest): each is reproducible on its own.
    alone = post(tiny, "/v1/completions", {**body, "n": 1, "seed": 8})
    assert alone["choices"][0]["text"] == texts[1]
    chat_body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 6,
        "n": 2,
        "temperature": 1.0,
        "top_k": 0,
        "seed": 3,
    }
    chat_whole = post(tiny, "/v1/chat/completions", chat_body)
    chat_chunks = events(tiny, "/v1/chat/completions", chat_body)
    roles = [c["choices"][0]["index"] for c in chat_chunks if "role" in c["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1]  # each choice opens with its role, as vLLM's
    contents = {0: "", 1: ""}
    for chunk in chat_chunks:
        (choice,) = chunk["choices"]
        contents[choice["index"]] += choice["delta"].get("content", "")
    assert contents == {c["index"]: c["message"]["content"] for c in chat_whole["choices"]}


def test_every_choice_leaves_on_an_error_or_a_disconnect(tiny: Running) -> None:
    """A deadline refuses all n (504, never run); a client that leaves a stream of n ends every choice.
    Either way nothing stays in flight, waiting or running."""

    def settled() -> bool:
        return (
            tiny.metric("carpool_inflight_requests", model="tiny") == 0
            and tiny.metric("carpool_running_sequences", model="tiny") == 0
            and tiny.waiting() == 0
        )

    body = {"prompt": "the quick brown fox", "max_tokens": 100, "n": 3, "ignore_eos": True}
    late = tiny.client.post("/v1/completions", json=body, headers={"x-carpool-timeout": "0.000001"})
    assert late.status_code == 504, late.text
    wait_for(settled, what="every choice gone after a 504")
    with stream_then_leave(tiny.url, {**body, "stream": True}):
        pass
    wait_for(settled, what="every choice gone after a disconnect")


def test_a_client_that_leaves_a_stream_of_n_choices_ends_every_one_at_once() -> None:
    """On the scripted engine, whose decoding steps are held here once every choice has its first token:
    the client leaves while none can finish, and the front withdraws all three (the request leaves the
    in-flight count with the engine still held), and the engine drops them (nothing runs once it goes on)."""
    engine = ScriptedGenerator()
    held, step = threading.Event(), engine.step

    def holding_step(plan: Any, params: Any) -> dict[int, int]:
        if plan.work and all(work.seq.output for work in plan.work):  # decoding only: hold it
            held.wait(timeout=60)
        return step(plan, params)

    engine.step = holding_step  # type: ignore[method-assign]
    config = runtime_config(model={"name": "fake", "task": "generate"}, warmup={"enabled": False})
    with serve(config, factory(engine)) as server:
        try:
            body = {"prompt": "hello world", "max_tokens": 100, "n": 3, "stream": True}
            with stream_then_leave(server.url, body):
                wait_for(
                    lambda: server.metric("carpool_running_sequences", model="fake") == 3, what="running"
                )
            wait_for(lambda: server.metric("carpool_inflight_requests", model="fake") == 0, what="withdrawn")
        finally:
            held.set()
        wait_for(lambda: server.metric("carpool_running_sequences", model="fake") == 0, what="dropped")
        assert len(engine.forgotten) >= 3
        assert server.metric("carpool_generated_tokens_total", model="fake") < 3 * 10


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "logit_bias", {"1000000": 5}),
        ("/v1/completions", "logit_bias", {"-1": 5}),
        ("/v1/completions", "logit_bias", {"fox": 5}),
        ("/v1/chat/completions", "logit_bias", {"1000000": 5}),
        ("/v1/completions", "min_p", 1.5),
        ("/v1/chat/completions", "min_p", -0.5),
        ("/v1/completions", "n", 0),
        ("/v1/chat/completions", "n", 100_000),  # past what one request may queue
    ],
)
def test_out_of_range_logit_bias_min_p_and_n_are_refused_naming_the_field(
    tiny: Running, path: str, field: str, value: Any
) -> None:
    _refused_naming(tiny, path, field, value)
