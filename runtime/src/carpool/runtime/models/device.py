"""Device and precision choice, and recognising out-of-memory errors.

`model.dtype: auto` serves bfloat16 where the hardware computes it natively: CPUs with AVX512-BF16 or AMX
(oneDNN's bf16 matmuls; issue 26 measured MiniLM at 1.75x float32's inputs/s on an EPYC, cosine to
float32's >= 0.9998) and CUDA GPUs that support it (Ampere on); float16 on older GPUs and float32 on
other CPUs, where bf16 is emulated and slower than float32. Causal LMs on CPU stay float32 under
`auto` (see `choose_precision`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from carpool.runtime.config import ConfigError, DType, Task

_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}


def choose_device(requested: str) -> torch.device:
    attention_backends(os.environ.get(ATTENTION_BACKENDS_ENV))  # a typo there fails the start, not a request
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise ConfigError(f"model.device {requested!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device is {requested!r} but no CUDA device is available")
    return device


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of x86 CPUs that compute bfloat16 matmuls natively."""


def cpu_bf16_flags(cpuinfo: str) -> list[str]:
    """The native-bf16 flags among the `flags` lines of a /proc/cpuinfo text."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def host_cpu_bf16_flags() -> list[str]:
    try:
        return cpu_bf16_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return []


@dataclass(frozen=True)
class Precision:
    """The dtype served and why (the why goes into the start-up log)."""

    dtype: torch.dtype
    reason: str


def choose_precision(
    requested: DType, device: torch.device, cpu_flags: list[str] | None = None, task: Task = Task.EMBED
) -> Precision:
    """`model.dtype` resolved for `device` and `task`; `cpu_flags` (native-bf16 flags) default to this
    host's. On CPU, `auto` keeps causal LMs in float32: SmolLM2-135M in bfloat16 (even with a float32
    lm_head) gave float32's first 16 greedy tokens in 59% (69%) of 32 prompts, against the 90%
    `tests/runtime/test_quality.py` holds the chosen precision to; `model.dtype: bfloat16` opts in."""
    if requested is DType.FLOAT16 and device.type == "cpu":
        raise ConfigError("model.dtype float16 is not supported on CPU; use bfloat16 or float32")
    if requested is not DType.AUTO:
        return Precision(_DTYPES[requested], f"model.dtype {requested.value}")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision(torch.bfloat16, "model.dtype auto: the GPU supports bfloat16")
        return Precision(torch.float16, "model.dtype auto: the GPU has no bfloat16")
    flags = host_cpu_bf16_flags() if cpu_flags is None else cpu_flags
    if device.type == "cpu" and flags and task is Task.GENERATE:
        return Precision(
            torch.float32,
            f"model.dtype auto: the CPU has {' and '.join(flags)}, but generation stays float32 "
            "(bfloat16 greedy output drifts from float32's; set model.dtype bfloat16 to opt in)",
        )
    if device.type == "cpu" and flags:
        return Precision(torch.bfloat16, f"model.dtype auto: the CPU has {' and '.join(flags)}")
    return Precision(torch.float32, f"model.dtype auto: no native bfloat16 on {device.type}")


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError | MemoryError)


def release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# Every SDPA backend but cuDNN's: cuDNN attention builds an execution plan for each new input shape
# (tens to hundreds of milliseconds on an H100), and a dynamic batcher makes a new shape with nearly every
# batch. Measured on an H100 with MiniLM, 32 mixed-length inputs a batch: p99 121 ms with cuDNN allowed,
# 10 ms without; flash and memory-efficient attention need no per-shape plan.
_STEADY_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


_BACKEND_NAMES = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
ATTENTION_BACKENDS_ENV = "CARPOOL_ATTENTION_BACKENDS"
"""A comma-separated list of the SDPA kernels the model may use (flash, efficient, cudnn, math), on any
device: to work around a kernel's fault, or to prove the model's code does not depend on one kernel's output
layout (`CARPOOL_ATTENTION_BACKENDS=math` runs what CUDA runs for masked grouped-query attention)."""


def attention_backends(value: str | None) -> list[SDPBackend] | None:
    """The kernels `value` (the environment variable's text) names, or None when it is unset or empty."""
    if not value or not value.strip():
        return None
    names = [name.strip().lower() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in _BACKEND_NAMES]
    if unknown:
        raise ConfigError(
            f"{ATTENTION_BACKENDS_ENV}={value!r}: unknown attention kernel(s) {unknown}; "
            f"choose from {sorted(_BACKEND_NAMES)}"
        )
    return [_BACKEND_NAMES[name] for name in names]


@contextlib.contextmanager
def inference(device: torch.device) -> Iterator[None]:
    """Inference mode, and the attention kernels allowed: those of `CARPOOL_ATTENTION_BACKENDS` where it is
    set, otherwise on CUDA the kernels whose cost does not depend on new shapes, on CPU PyTorch's choice."""
    chosen = attention_backends(os.environ.get(ATTENTION_BACKENDS_ENV))
    if chosen is None and device.type == "cuda":
        chosen = _STEADY_BACKENDS
    with torch.inference_mode(), sdpa_kernel(chosen) if chosen is not None else contextlib.nullcontext():
        yield
