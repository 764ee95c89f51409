"""vLLM's OpenAI surface, whole, under carpool's: the same requests sent to vLLM's own server and to the
carpool pod on vLLM's engine (same converted SmolLM2, greedy unless a seed says otherwise), and the
answers compared: status, texts, tool calls, choice counts, token ids. Both run the `pythonic` tool-call
parser (SmolLM2's chat template has no tool-call tokens of its own, so hermes-style parsers, which need
`<tool_call>` in the vocabulary, cannot start; pythonic reads `[f(x=1)]` from plain text), given to the
pod as `model.vllmArgs` and to vLLM's server as its flags.

Not compared: ids, `created`, `model` (the two serve the model under different names), and fields that
carry timings or system fingerprints."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import pytest

from .conftest import NAME, Reference, Served

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}

REASONED = "Here is my thought process: [a-z ]{1,24}[.] Here is my response: [A-Z][a-z]{1,10}"
"""Text that the tier's reasoning parser (granite) splits into reasoning and content."""

PARITY: dict[str, tuple[str, dict[str, Any]]] = {
    "json_object": ("chat", {"messages": CHAT, "response_format": {"type": "json_object"}}),
    "json_schema": (
        "chat",
        {
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
        },
    ),
    "structured_choice": ("chat", {"messages": CHAT, "structured_outputs": {"choice": ["Paris", "London"]}}),
    "structured_regex": (
        "chat",
        {"messages": CHAT, "structured_outputs": {"regex": "[A-Z][a-z]+ is [a-z]+"}},
    ),
    "structured_json": ("chat", {"messages": CHAT, "structured_outputs": {"json": CITY}}),
    "structured_grammar": (
        "chat",
        {
            "messages": CHAT,
            "structured_outputs": {"grammar": 'root ::= "The capital is " ("Paris" | "Rome")'},
        },
    ),
    "reasoning": ("chat", {"messages": CHAT, "structured_outputs": {"regex": REASONED}, "max_tokens": 64}),
    "completions_json_schema": (
        "completions",
        {
            "prompt": "A city as JSON:",
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
        },
    ),
    "tools_none": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": "none",
        },
    ),
    "tools_required_not_parallel": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris and in Rome?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
    ),
    "tools_required_parallel": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris and in Rome?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_tokens": 48,
        },
    ),
    "tools_auto": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": "auto",
        },
    ),
    "tools_required": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
        },
    ),
    "tools_named": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
    "tool_results_in_history": (
        "chat",
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
            ],
            "tools": [WEATHER],
        },
    ),
    "n2_seeded": ("chat", {"messages": CHAT, "n": 2, "temperature": 0.8, "seed": 11}),
    "penalties": (
        "chat",
        {"messages": CHAT, "frequency_penalty": 1.2, "presence_penalty": 0.6, "repetition_penalty": 1.3},
    ),
    "logit_bias_min_p": ("chat", {"messages": CHAT, "logit_bias": {"504": -100, "3914": 5}, "min_p": 0.05}),
    "min_tokens_ignore_eos": (
        "chat",
        {"messages": CHAT, "min_tokens": 20, "ignore_eos": True, "max_tokens": 24},
    ),
    "stop_token_ids_bad_words": ("chat", {"messages": CHAT, "stop_token_ids": [28], "bad_words": ["Paris"]}),
    "content_parts": (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is the capital"},
                        {"type": "text", "text": " of France?"},
                    ],
                }
            ]
        },
    ),
    "named_message_and_template_kwargs": (
        "chat",
        {
            "messages": [{"role": "user", "name": "ada", "content": "Hello"}],
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ),
    "continue_final_message": (
        "chat",
        {
            "messages": [*CHAT, {"role": "assistant", "content": "The capital of France is"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
    "chat_logprobs": ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 2}),
    "echo": ("completions", {"prompt": "The capital of France is", "echo": True}),
    "prompt_logprobs": (
        "completions",
        {"prompt": "The capital of France is", "prompt_logprobs": 2, "max_tokens": 4},
    ),
    "several_prompts": ("completions", {"prompt": ["The capital of France is", "Once upon a time"]}),
    "token_id_prompts": ("completions", {"prompt": [[504, 3575, 282, 4649, 314], [11111, 2056, 253, 655]]}),
    "completion_logprobs": ("completions", {"prompt": "def fibonacci(n):", "logprobs": 3}),
    "refused_logprobs_over_the_limit": ("completions", {"prompt": "Hello", "logprobs": 50}),
    "refused_unknown_tool_choice": (
        "chat",
        {
            "messages": CHAT,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    ),
    "refused_n_zero": ("chat", {"messages": CHAT, "n": 0}),
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def comparable(answer: dict[str, Any]) -> Any:
    """What must be equal: per choice its text or message (content, tool calls' names and arguments,
    reasoning), finish reason, logprobs' tokens, prompt token ids; the error's status and parameter."""
    if "error" in answer:
        return {"error_code": answer["error"].get("code")}
    choices = []
    for choice in answer["choices"]:
        kept: dict[str, Any] = {"index": choice["index"], "finish_reason": choice.get("finish_reason")}
        if "text" in choice:
            kept["text"] = choice["text"]
        if "message" in choice:
            message = choice["message"]
            kept["content"] = message.get("content")
            kept["reasoning"] = message.get("reasoning") or message.get("reasoning_content")
            kept["tool_calls"] = [
                (call["function"]["name"], json.loads(call["function"]["arguments"]))
                for call in message.get("tool_calls") or []
            ]
        logprobs = choice.get("logprobs")
        if logprobs and "tokens" in logprobs:
            kept["logprob_tokens"] = logprobs["tokens"]
        elif logprobs and logprobs.get("content"):
            kept["logprob_tokens"] = [entry["token"] for entry in logprobs["content"]]
        if choice.get("prompt_logprobs") is not None:
            kept["prompt_logprob_ids"] = [
                sorted(position) if position else None for position in choice["prompt_logprobs"]
            ]
        choices.append(kept)
    top = answer.get("prompt_logprobs")
    return {
        "choices": choices,
        "usage": answer.get("usage", {}).get("completion_tokens"),
        "prompt_logprobs": top is not None,
    }


def ask(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    answer = client.post(path, json=body)
    return answer.status_code, answer.json()


@pytest.fixture(scope="module")
def both(served: Served, reference: Reference) -> tuple[httpx.Client, httpx.Client]:
    return served.client(), httpx.Client(base_url=reference.url, timeout=300)


@pytest.mark.parametrize("case", list(PARITY))
def test_the_same_request_gets_the_same_answer_as_from_vllms_own_server(
    case: str, both: tuple[httpx.Client, httpx.Client], reference: Reference
) -> None:
    ours, theirs = both
    kind, body = PARITY[case]
    body = {"temperature": 0, "max_tokens": 16, **body}
    status, answer = ask(ours, PATHS[kind], {**body, "model": NAME})
    expected_status, expected = ask(theirs, PATHS[kind], {**body, "model": reference.model})
    assert status == expected_status, (answer, expected)
    assert comparable(answer) == comparable(expected)
    if case.startswith("refused"):
        assert status == 400 and answer["error"]["message"] == expected["error"]["message"]
    elif case == "reasoning":
        (choice,) = comparable(answer)["choices"]
        assert choice["reasoning"] and choice["content"], choice
    else:
        assert status == 200, answer


def test_streamed_chat_tool_call_and_reasoning_deltas_add_up_as_from_vllms_own_server(
    both: tuple[httpx.Client, httpx.Client], reference: Reference
) -> None:
    ours, theirs = both

    def stream(client: httpx.Client, model: str, body: dict[str, Any]) -> tuple[str, str, str, str]:
        text, name, arguments, reasoning = "", "", "", ""
        full = {"model": model, "temperature": 0, "max_tokens": 24, "stream": True, **body}
        with client.stream("POST", "/v1/chat/completions", json=full) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    delta = choice["delta"]
                    text += delta.get("content") or ""
                    reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
                    for call in delta.get("tool_calls") or []:
                        name += call.get("function", {}).get("name") or ""
                        arguments += call.get("function", {}).get("arguments") or ""
        return text, name, arguments, reasoning

    for body in (
        {"messages": CHAT},
        {"messages": CHAT, "structured_outputs": {"regex": REASONED}, "max_tokens": 64},
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
        },
    ):
        mine = stream(ours, NAME, body)
        assert mine == stream(theirs, reference.model, body)
        assert any(mine)
        if "structured_outputs" in body:
            assert mine[0] and mine[3], mine  # reasoning deltas, then content ones


def test_tokenize_and_detokenize_answer_as_vllms_own_server(
    both: tuple[httpx.Client, httpx.Client], reference: Reference
) -> None:
    ours, theirs = both
    for path, body in (
        ("/tokenize", {"prompt": "The capital of France is"}),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": True}),
        ("/detokenize", {"tokens": [504, 3575, 282, 4649, 314]}),
    ):
        status, answer = ask(ours, path, {**body, "model": NAME})
        expected_status, expected = ask(theirs, path, {**body, "model": reference.model})
        assert (status, answer) == (expected_status, expected)
        assert status == 200


def _inlined(document: dict[str, Any], node: Any, stack: tuple[str, ...] = ()) -> Any:
    """`node` with every `$ref` into `document`'s schemas replaced by what it names (a name already being
    inlined stays a reference, by its name without carpool's `vllm.` prefix)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            name = ref.removeprefix("#/components/schemas/")
            plain = name.removeprefix("vllm.")
            if plain in stack:
                return {"$ref": plain}
            return _inlined(document, document["components"]["schemas"][name], (*stack, plain))
        return {key: _inlined(document, value, stack) for key, value in node.items()}
    if isinstance(node, list):
        return [_inlined(document, value, stack) for value in node]
    return node


def test_openapi_describes_the_openai_routes_with_vllms_own_request_schemas(
    both: tuple[httpx.Client, httpx.Client],
) -> None:
    """A client generated from, or validating against, the pod's /openapi.json must take every field vLLM's
    server takes (carpool's own request schemas refuse structured output and tools): each OpenAI route's
    request body is vLLM's own, and carpool's answers stay documented (429 and 503 with Retry-After)."""
    ours, theirs = both
    mine, expected = ours.get("/openapi.json").json(), theirs.get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        operation, reference = mine["paths"][path]["post"], expected["paths"][path]["post"]
        assert _inlined(mine, operation["requestBody"]) == _inlined(expected, reference["requestBody"]), path
        assert operation["responses"]["429"]["headers"]["Retry-After"], path
        assert "422" not in operation["responses"], path
    validator = jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/ChatCompletionRequest", **mine}  # refs resolve within the document
    )
    assert mine["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"] == {
        "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}
    }
    for case, (kind, body) in PARITY.items():
        if kind == "chat" and not case.startswith("refused"):
            errors = [error.message for error in validator.iter_errors({**body, "model": NAME})]
            assert not errors, (case, errors)


def test_the_models_generation_config_applies_where_a_request_is_silent(
    both: tuple[httpx.Client, httpx.Client], reference: Reference
) -> None:
    """No temperature, top_p or max_tokens: each server applies the model's generation_config (and the
    same context) as vLLM does; with a seed the sampled texts agree."""
    ours, theirs = both
    body = {"messages": CHAT, "seed": 5, "max_tokens": 12}
    status, answer = ask(ours, "/v1/chat/completions", {**body, "model": NAME})
    _, expected = ask(theirs, "/v1/chat/completions", {**body, "model": reference.model})
    assert status == 200
    assert comparable(answer) == comparable(expected)


def test_carpools_additions_stay_keys_priority_header_and_a_bad_one_named(served: Served) -> None:
    with served.client(key=None) as anonymous:
        refused = anonymous.post("/v1/chat/completions", json={"messages": CHAT})
    assert refused.status_code == 401
    with served.client() as client:
        bad = client.post(
            "/v1/chat/completions", json={"messages": CHAT}, headers={"x-carpool-priority": "high"}
        )
        assert bad.status_code == 400 and "x-carpool-priority" in bad.json()["error"]["message"]
        fine = client.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 4, "temperature": 0},
            headers={"x-carpool-priority": "2", "x-carpool-timeout": "120"},
        )
        assert fine.status_code == 200, fine.text
        gone = client.post("/v1/chat/completions", json={"messages": CHAT, "model": "whisper"})
        assert gone.status_code == 404, gone.text
