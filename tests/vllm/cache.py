"""The model cache claim of a pod on vLLM's engine, as the tests stand it in: a folder whose `vllm/` and
`carpool/` (what XDG_CACHE_HOME=/var/cache/carpool makes vLLM's compile cache and carpool's GGUF
conversion) link to this machine's caches, so a pod's start reuses what earlier starts compiled and
converted (without them every start compiles for minutes)."""

from __future__ import annotations

import os
from pathlib import Path


def model_cache(folder: Path) -> Path:
    folder.mkdir()
    machine = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    for name in ("vllm", "carpool"):
        (machine / name).mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(machine / name)
    return folder
