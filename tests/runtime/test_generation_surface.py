"""The OpenAI surface of a model on carpool's own engine, beyond plain text: the model's generation-config
defaults where a request is silent, content parts, a message's `name`, `/tokenize` and `/detokenize` in
vLLM's shapes, and what it cannot do refused by name (a model on vLLM's engine answers all of vLLM's
surface: tests/vllm/test_surface.py). On a tiny random Llama (gibberish, but deterministic) whose
`generation_config.json` says `top_k: 1` (greedy)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from carpool.runtime.engine.process import load_engine
from tests.runtime.conftest import Running, serve
from tests.runtime.factories import runtime_config
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


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "response_format", {"type": "json_object"}),
        ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/completions", "logit_bias", {"5": -100}),
        ("/v1/completions", "min_p", 0.1),
        ("/tokenize", "tools", []),
    ],
)
def test_what_carpools_engine_cannot_do_is_refused_naming_the_field(
    tiny: Running, path: str, field: str, value: Any
) -> None:
    base = (
        {"prompt": "hi"}
        if path != "/v1/chat/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    answer = post(tiny, path, {**base, field: value}, status=400)
    assert field in answer["error"]["message"]


def test_kserve_v2_generation_takes_the_same_defaults_and_refuses_what_it_does_not_offer(
    tiny: Running,
) -> None:
    def v2(status: int = 200, **parameters: Any) -> dict[str, Any]:
        inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["the quick brown fox"]}]
        body = {"inputs": inputs, "parameters": {"max_tokens": 10, **parameters}}
        return post(tiny, "/v2/models/tiny/infer", body, status)

    assert v2(seed=1)["outputs"][0]["data"] == v2(seed=2)["outputs"][0]["data"] == [text(tiny, top_k=1)]
    refused = v2(400, min_p=0.5)
    assert "parameters.min_p" in refused["error"]
