"""Encoder projections on a CPU with their weights packed once, at load, for oneDNN.

`torch.nn.functional.linear` on a CPU hands the weight to the BLAS in its stored layout, and the library
reorders (packs) it into its own blocked layout on every call. An encoder's projections hold most of its
weights (MiniLM: 6 layers x 1.8M of 22M parameters), so a forward of few tokens is bound by streaming
each weight twice: on this project's 2-core EPYC a lone 8-token MiniLM forward took 8.4 ms in bfloat16,
most of it in `addmm`, at a quarter of what the memory delivers. A weight packed once for oneDNN
(`torch.ops.mkldnn._reorder_linear_weight`, the prepacking that torch.compile's CPU backend does under
`freezing`) is read as it is: the same projection of 8 rows took about half the time (fp32 and bf16),
of 64 rows three quarters; at a full batch's thousands of rows the packed and the plain kernel are about
even, and in bfloat16 the plain one can win (bench/RESULTS.md, 2026-12-06).

So `install` times both on the model's own projections at load, at row counts from a lone short input to
a full batch (every projection in turn, as a forward reads them, so the weights are not already in the
cache), and packs only where the packed kernel won: `PrepackedLinear` runs the packed weight for inputs
of up to `packed_rows` rows and the model's own weight above. Where the packed kernel won at every row
count the plain weight is released, so memory stays what it was; otherwise both are kept (the log line
says how much more memory that is). Outputs equal the plain projection's to rounding: checked at load on
one projection and on a forward pass of the whole model (`probe_forward`), which also catches a model
whose code reads a projection's `weight` itself; on any difference or failure the plain modules go back
and nothing is packed. CPUs only; on a GPU nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from carpool.runtime.models import quant

ROWS = (8, 32, 128, 512)
"""Row counts timed at load, from one short input up (packed rows are tokens). A kernel that wins at 512
rows runs every batch: on MiniLM the packed one won at 2,048 rows too (0.88x in float32, 0.93x in
bfloat16), and timing full batches at load would cost seconds on a large model."""
PACK_HINT = 64
"""The row count oneDNN chooses the packed layout for (`_reorder_linear_weight`'s batch size)."""
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
"""Largest difference from the plain projection, relative to its largest output, that packing accepts."""


def available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear kernel."""
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU: bfloat16 packing needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT (a Zen 2 or 3 EPYC has neither, and the reorder raises), float32 packs everywhere."""
    if not available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACK_HINT)
    except RuntimeError:
        return False
    return True


def packed_rows_from(dense_s: Sequence[float], packed_s: Sequence[float], rows: Sequence[int]) -> int:
    """Up to how many rows the packed kernel runs: the largest timed row count up to which it won at every
    one (0: it lost at the smallest, nothing is packed). Past the largest timed count it is trusted only
    if it won there too (then every count: `ALL_ROWS`)."""
    chosen = 0
    for dense, packed, count in zip(dense_s, packed_s, rows, strict=True):
        if packed >= dense:
            return chosen
        chosen = count
    return ALL_ROWS


ALL_ROWS = 1 << 62
"""`packed_rows` when the packed kernel won at every timed row count: it runs everything."""


class PrepackedLinear(nn.Module):
    """`nn.Linear` with its weight packed for oneDNN, run for inputs of up to `packed_rows` rows; the
    plain weight above (`release` drops it when the packed one runs everything)."""

    def __init__(self, linear: nn.Linear, packed_rows: int, packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_rows = packed_rows
        self.packed = (
            packed
            if packed is not None
            else torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_HINT)
        )
        self.bias = linear.bias
        self.weight: torch.Tensor | None = linear.weight

    def release(self) -> None:
        """Drop the plain weight: the packed one runs every input (`packed_rows` becomes `ALL_ROWS`)."""
        self.packed_rows = ALL_ROWS
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.packed_rows and self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rows = "all" if self.packed_rows == ALL_ROWS else self.packed_rows
        return f"in_features={self.in_features}, out_features={self.out_features}, packed up to {rows} rows"


@dataclass(frozen=True)
class Choice:
    """What `install` decided, with the timings it decided on."""

    layers: int
    packed_rows: int
    """0 when nothing is packed; `ALL_ROWS` when the packed kernel runs everything."""
    dense_s: tuple[float, ...]
    packed_s: tuple[float, ...]
    rows: tuple[int, ...]
    extra_bytes: int
    """Memory held beyond the model's own: the packed weights where the plain ones are kept too."""
    reason: str = ""


Timer = Callable[[Callable[[], object]], float]


def best_of(run: Callable[[], object]) -> float:
    """Seconds of the faster of two calls, after one untimed call (`quant.best_of` on the CPU)."""
    run()
    return quant.best_of(run, torch.device("cpu"), repeats=2)


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every plain `nn.Linear` of the model (not subclasses: LoRA, quantized layers), with its parent."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if (
                type(child) is nn.Linear
                and child.weight.dtype in TOLERANCE
                and child.weight.device.type == "cpu"
            ):
                found.append((parent, name, child))
    return found


def install(
    model: nn.Module,
    rows: Sequence[int] = ROWS,
    timer: Timer = best_of,
    probe: Callable[[], object] | None = None,
) -> Choice:
    """Time the model's projections plain and packed at each of `rows`; swap in `PrepackedLinear` where
    packing won (see the module docstring). With `probe` (a forward pass of the model, `probe_forward`),
    the packed model must give the plain one's output, else the swap is undone. The model must be on
    the CPU, in eval mode."""
    linears = _linears(model)
    if not linears:
        return Choice(0, 0, (), (), tuple(rows), 0, "no plain projections")
    if not available():
        return Choice(len(linears), 0, (), (), tuple(rows), 0, "this torch has no oneDNN prepacked kernel")
    dtype = linears[0][2].weight.dtype
    if not packs(dtype):
        return Choice(len(linears), 0, (), (), tuple(rows), 0, f"oneDNN packs no {dtype} weights on this CPU")
    with torch.inference_mode():
        packed = [torch.ops.mkldnn._reorder_linear_weight(lin.weight, PACK_HINT) for _, _, lin in linears]
        dense_s, packed_s = [], []
        for count in rows:
            inputs = {
                lin.in_features: torch.randn(count, lin.in_features, dtype=dtype) for _, _, lin in linears
            }
            first = linears[0][2]
            expected = F.linear(inputs[first.in_features], first.weight, first.bias).float()
            got = torch.ops.mkldnn._linear_pointwise(
                inputs[first.in_features], packed[0], first.bias, "none", [], ""
            ).float()
            error = float((expected - got).abs().max() / expected.abs().max().clamp(min=1e-6))
            if error > TOLERANCE.get(dtype, 0.0):
                return Choice(
                    len(linears), 0, (), (), tuple(rows), 0, f"packed outputs {error:.1g} off the plain ones"
                )

            def plain(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for _, _, lin in linears:
                    F.linear(inputs[lin.in_features], lin.weight, lin.bias)

            def prepacked(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for (_, _, lin), weight in zip(linears, packed, strict=True):
                    torch.ops.mkldnn._linear_pointwise(
                        inputs[lin.in_features], weight, lin.bias, "none", [], ""
                    )

            dense_s.append(timer(plain))
            packed_s.append(timer(prepacked))
    packed_rows = packed_rows_from(dense_s, packed_s, rows)
    timings = (tuple(dense_s), tuple(packed_s), tuple(rows))
    if not packed_rows:
        return Choice(len(linears), 0, *timings, 0)
    reference = _probe_output(probe) if probe is not None else None
    if isinstance(reference, str):
        return Choice(len(linears), 0, *timings, 0, f"the model's probe forward failed: {reference}")
    layers = [
        PrepackedLinear(lin, packed_rows, weight) for (_, _, lin), weight in zip(linears, packed, strict=True)
    ]
    extra = 0
    for (parent, name, _), layer in zip(linears, layers, strict=True):
        setattr(parent, name, layer)
        if packed_rows == ALL_ROWS:
            layer.release()
        elif layer.weight is not None:
            extra += layer.weight.numel() * layer.weight.element_size()
    if probe is not None and reference is not None:
        problem = _compare(reference, _probe_output(probe), dtype)
        if problem:  # the plain modules are still here (`linears`): put them back
            for parent, name, lin in linears:
                setattr(parent, name, lin)
            return Choice(len(linears), 0, *timings, 0, f"the packed model {problem}")
    return Choice(len(linears), packed_rows, *timings, extra)


def probe_forward(model: nn.Module) -> Callable[[], object]:
    """A forward pass of eight token ids (1-8, in every vocabulary) through an encoder or a sequence
    classifier: `install` compares its output before and after packing."""
    ids = torch.arange(1, 9).unsqueeze(0)
    return lambda: model(input_ids=ids)


def _probe_output(probe: Callable[[], object]) -> torch.Tensor | str:
    """The probe's first output (last hidden state, logits) in float32, or why it failed."""
    try:
        with torch.inference_mode():
            output: Any = probe()
            first = output[0] if not isinstance(output, torch.Tensor) else output
            return torch.as_tensor(first).float()
    except Exception as exc:  # any failure means: do not pack
        return f"{type(exc).__name__}: {exc}"


def _compare(reference: torch.Tensor, got: torch.Tensor | str, dtype: torch.dtype) -> str:
    """What is wrong with the packed model's probe output, or "" if nothing."""
    if isinstance(got, str):
        return f"failed a forward pass ({got})"
    if got.shape != reference.shape:
        return f"gave a {tuple(got.shape)} output for {tuple(reference.shape)}"
    error = float((got - reference).abs().max() / reference.abs().max().clamp(min=1e-6))
    if not error <= TOLERANCE.get(dtype, 0.0):
        return f"gave outputs {error:.1g} off the plain model's"
    return ""


def describe(choice: Choice) -> str:
    """One log line: what was packed, the timings it rests on, and the memory it costs."""
    if choice.reason:
        return f"prepacked projections: off ({choice.reason})"
    timings = ", ".join(
        f"{rows} rows {packed * 1e3:.2f} ms packed / {dense * 1e3:.2f} plain"
        for rows, dense, packed in zip(choice.rows, choice.dense_s, choice.packed_s, strict=True)
    )
    if not choice.packed_rows:
        return f"prepacked projections: off (the plain kernel was as fast: {timings})"
    upto = (
        "every batch" if choice.packed_rows == ALL_ROWS else f"batches of up to {choice.packed_rows} tokens"
    )
    memory = f"{choice.extra_bytes / 2**20:.0f} MiB more memory" if choice.extra_bytes else "no more memory"
    return f"prepacked projections: {choice.layers} layers packed for {upto}, {memory} ({timings})"
