"""Attention outputs in the layouts accelerator kernels return them in: test_attention_layouts, test_segments.

Each kernel hands back `scaled_dot_product_attention`'s [batch, heads, length, dim] result in memory of its
own: the math kernel (which CUDA takes for masked grouped-query attention) in that order; flash and
memory-efficient attention as [batch, length, heads, dim]; cuDNN following the query's strides; a kernel that
pads the head dimension as a slice of a wider tensor. No CPU kernel returns most of these, so `layout(name)`
makes them from the real kernel's values (and runs the math kernel for real).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA = Callable[..., torch.Tensor]


def _restrided(make: Callable[[torch.Tensor, tuple[Any, ...]], torch.Tensor]) -> Callable[[SDPA], SDPA]:
    """An SDPA whose result has the real kernel's values in the memory `make(result, args)` lays out."""

    def wrap(sdpa: SDPA) -> SDPA:
        def patched(*args: Any, **kwargs: Any) -> torch.Tensor:
            result = sdpa(*args, **kwargs)
            laid = make(result, args)
            assert laid.shape == result.shape
            laid.copy_(result)
            return laid

        return patched

    return wrap


def _transposed(result: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    """flash and memory-efficient attention: [b, l, h, d] memory under the [b, h, l, d] shape."""
    b, h, length, d = result.shape
    return result.new_empty(b, length, h, d).transpose(1, 2)


def _query_following(result: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    """cuDNN: the output's dimensions ordered in memory as the query's are."""
    query = args[0]
    order = sorted(range(4), key=lambda i: (-query.stride(i), i))
    empty = result.new_empty([result.shape[i] for i in order])
    return empty.permute([order.index(i) for i in range(4)])


def _padded_head(result: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    """A kernel that computes with the head dimension padded to a multiple of 64 and returns a slice."""
    b, h, length, d = result.shape
    return result.new_empty(b, h, length, d + 64 - d % 64)[..., :d]


LAYOUTS: dict[str, Callable[[torch.Tensor, tuple[Any, ...]], torch.Tensor]] = {
    "flash-transposed": _transposed,
    "cudnn-query-following": _query_following,
    "padded-head-dim": _padded_head,
}


@contextmanager
def layout(name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if name == "math-kernel":
        with sdpa_kernel([SDPBackend.MATH]):
            yield
        return
    with monkeypatch.context() as patch:
        patched = _restrided(LAYOUTS[name])(F.scaled_dot_product_attention)
        patch.setattr(F, "scaled_dot_product_attention", patched)
        yield
