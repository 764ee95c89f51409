"""The native front (`server.native_front`): `carpool-front`, a Rust process that owns the API port.

    supervisor
    ├── engine process(es)
    ├── front processes (Python)   on Unix sockets in the supervisor's folder (`front-<k>.sock`)
    └── carpool-front (native)     on the API port; its own engine output (the last front slot)

It answers `POST /v1/embeddings` of an embedding model on carpool's engine itself (key check, parsing,
tokenization with the engine's tokenizer, the engine round trip over the same ZeroMQ wire as a Python
front, the OpenAI answer, the request metrics in the multiprocess files), and passes every other request,
and every embeddings request it would not answer exactly as a Python front does (a malformed body, an
unknown field, a LoRA adapter, a bad key, an input over the limits, an engine not ready), to a Python
front, one upstream connection per client connection. Errors, other routes, streaming and the Python
fronts' drain (`Connection: close`, 503 to new connections) thus reach the client unchanged.

Why: a Python front spends about 150 us of CPU per embeddings request (uvicorn, the ASGI layers,
asyncio), which caps a GPU's throughput long before the model does (issue 46; bench/RESULTS.md). The
binary is built from native/front (`make native`) into the environment's bin folder; `CARPOOL_NATIVE_FRONT`
names another.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
from pathlib import Path

from carpool.runtime.children import PopenChild
from carpool.runtime.config import RuntimeConfig, Task
from carpool.runtime.wire import Addresses

log = logging.getLogger(__name__)

BINARY = "carpool-front"
ENV = "CARPOOL_NATIVE_FRONT"


class NativeFrontMissing(RuntimeError):
    """`server.native_front` is on and no `carpool-front` binary is found."""


def binary() -> str:
    """The native front's executable: `CARPOOL_NATIVE_FRONT`, else beside this Python, else on PATH."""
    named = os.environ.get(ENV)
    if named:
        return named
    beside = Path(sys.executable).parent / BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(BINARY)
    if found is None:
        raise NativeFrontMissing(
            f"server.native_front is on but no {BINARY} binary was found (beside {sys.executable}, on PATH, "
            f"or named by {ENV}): build it with `make native`, or turn server.native_front off"
        )
    return found


def wanted(config: RuntimeConfig) -> str | None:
    """The native front's executable where this server runs one (`server.native_front`), else None.
    `auto` turns it on for an embedding model served over plain HTTP where the binary is installed."""
    setting = config.server.native_front
    if setting is False:
        return None
    if setting == "auto":
        if config.server.tls is not None or config.model.task is not Task.EMBED:
            return None
        try:
            return binary()
        except NativeFrontMissing:
            log.info("no %s binary: the Python fronts serve the port (make install builds it)", BINARY)
            return None
    return binary()


def upstream_path(folder: str, front: int) -> str:
    return os.path.join(folder, f"front-{front}.sock")


def bind_upstreams(folder: str, fronts: int, backlog: int) -> list[socket.socket]:
    """One listening Unix socket per Python front, where the native front passes requests on."""
    sockets: list[socket.socket] = []
    try:
        for front in range(fronts):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(upstream_path(folder, front))
            sock.listen(backlog)
            sock.set_inheritable(True)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def settings(config: RuntimeConfig, addresses: Addresses, folder: str, fronts: int) -> dict[str, object]:
    """What `carpool-front` reads (its one argument, as JSON, with `listen_fd` added as it starts): the
    native front is front slot `fronts`, after the Python fronts'."""
    server, batching = config.server, config.batching
    return {
        "upstreams": [upstream_path(folder, front) for front in range(fronts)],
        "engine_inputs": [addresses.engine_input(engine) for engine in range(addresses.engines)],
        "output": addresses.outputs[fronts],
        "front": fronts,
        "model": config.served_name(),
        "keys_file": str(server.api_keys_file) if server.api_keys_file is not None else None,
        "max_body_bytes": server.max_body_bytes,
        "items_limit": batching.items_limit,
        "priority_levels": batching.priority_levels,
        "default_priority": batching.default_priority,
        "request_timeout_s": config.request_timeout_s(),
        "drain_keep_alive_s": server.drain_keep_alive_s,
        "drain_timeout_s": config.drain_timeout(),
        "metrics_dir": os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
        "threads": max(1, fronts),
        "log_format": server.log_format,
        "log_level": server.log_level,
    }


class NativeFront(PopenChild):
    """The `carpool-front` process (`children.PopenChild`), given the listening socket as a descriptor."""

    name = "carpool-front-native"

    def __init__(self, executable: str, payload: dict[str, object], listener: socket.socket) -> None:
        super().__init__()
        self._executable = executable
        self._payload = payload
        self._listener = listener

    def start(self) -> None:
        fd = self._listener.fileno()
        self._launch([self._executable, json.dumps({**self._payload, "listen_fd": fd})], pass_fds=(fd,))
