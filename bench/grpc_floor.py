"""What `grpc.aio` itself costs per call: a server process whose ModelInfer returns a fixed answer at once,
under `bench.grpc_load`'s closed loop, CPU per call from /proc. The floor under `bench.front --protocols
grpc`: whatever carpool does per call comes on top of it.

    python -m bench.grpc_floor [--clients 16] [--seconds 10] [--loop uvloop|asyncio]

The server runs the event loop the fronts run (uvloop, as uvicorn picks it) unless `--loop asyncio`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import grpc_load
from bench.server import HOST, free_port, process_cpu_seconds

_SERVER = """
import asyncio, sys, grpc
async def answer(request, context):
    return b"\\n\\x04fake\\x12\\x011"
async def main():
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(answer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {"ModelInfer": handler}),)
    )
    server.add_insecure_port(sys.argv[1])
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()
if sys.argv[2] == "uvloop":
    import uvloop
    uvloop.install()
asyncio.run(main())
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="grpc.aio's own CPU per unary call.")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args(argv)
    target = f"{HOST}:{free_port()}"
    server = subprocess.Popen([sys.executable, "-c", _SERVER, target, args.loop], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        payloads = grpc_load.infer_payloads("fake", ["a short query of a dozen tokens or so"])
        asyncio.run(grpc_load.closed_loop(target, payloads, args.clients, duration_s=1.0))
        before, started = process_cpu_seconds(server.pid), time.monotonic()
        result = asyncio.run(grpc_load.closed_loop(target, payloads, args.clients, duration_s=args.seconds))
        cpu, wall = process_cpu_seconds(server.pid) - before, time.monotonic() - started
    finally:
        server.terminate()
        server.wait(10)
    ok = result.statuses.get(200, 0)
    print(
        f"grpc.aio ({args.loop}), fixed answer, {args.clients} clients: {ok / wall:.0f} calls/s, "
        f"server CPU per call {cpu / ok * 1e3:.3f} ms; load average {os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
