"""Device and precision choice, and recognising out-of-memory errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from carpool.runtime.config import ConfigError, DType

_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}


def choose_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise ConfigError(f"model.device {requested!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device is {requested!r} but no CUDA device is available")
    return device


def choose_dtype(requested: DType, device: torch.device) -> torch.dtype:
    if requested is DType.AUTO:
        return torch.float16 if device.type == "cuda" else torch.float32
    if requested is DType.FLOAT16 and device.type == "cpu":
        raise ConfigError("model.dtype float16 is not supported on CPU; use bfloat16 or float32")
    return _DTYPES[requested]


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


@contextlib.contextmanager
def inference(device: torch.device) -> Iterator[None]:
    """Inference mode, and on CUDA the attention backends whose cost does not depend on new shapes."""
    with (
        torch.inference_mode(),
        sdpa_kernel(_STEADY_BACKENDS) if device.type == "cuda" else contextlib.nullcontext(),
    ):
        yield
