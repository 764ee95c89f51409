"""Quantized linear layers for causal LMs: a GGUF's own 4-bit blocks served as 4 bits on CPU, FP8 on CUDA.

A GGUF Q4_1 block holds 32 weights as `w = d * q + m` (q in 0..15, d and m float16), Q4_0 as
`w = d * (q - 8)`. torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, groups of 32 along the input)
computes `(q - 8) * scale + zero` per group, so a block is one group with scale `d` and zero `m + 8d`
(Q4_1) or `0` (Q4_0), and the file's 4-bit codes are used as they are: no requantization. The kernel
takes bfloat16 activations and bfloat16 scales (its float32-activation path is a scalar fallback about
50x slower: it is never called here; a layer casts its input to bfloat16 first).

Which is faster depends on the rows of the step (issue 26's measurements on a 2-core EPYC, 30 layers'
projections: 1 row int4 5.7 ms against dense bf16 9.5, 16 rows 28 against 21), so `choose_kernels` times
both per layer shape and row bucket at load, and a layer keeps its dense bfloat16 weight only where the
dense matmul won some bucket.

`int8` (`_weight_int8pack_mm`, one scale per output channel) and `int4` on other weights quantize at load.
`fp8` (CUDA, compute capability 8.9 and later) stores float8 e4m3 weights with a scale per output
channel and quantizes each step's activations per row, multiplied by `torch._scaled_mm` (the GPU's FP8
tensor cores; oneDNN's kernel runs the same code path in the CPU tests). Pure conversions
(`gguf_q4_codes`, `quantize_int4`, `quantize_int8`, `quantize_fp8`) are apart from the modules.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from carpool.runtime.config import ConfigError

log = logging.getLogger(__name__)

GROUP = 32
"""Weights per int4 group: one GGUF Q4 block."""

Q4_TYPES = ("Q4_0", "Q4_1")
"""GGUF tensor types served in 4 bits as they are."""

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Rows of a step are timed at these sizes; a step uses the choice of the smallest bucket >= its rows."""

COMPUTE = torch.bfloat16
"""Activations and scales of the quantized kernels."""


@dataclass(frozen=True)
class Int4Codes:
    """A [out, in] weight as 4-bit codes and per-group (scale, zero): w = (q - 8) * scale + zero."""

    q: torch.Tensor
    """int32 [out, in], values 0..15."""
    scale: torch.Tensor
    """float32 [out, in / GROUP]."""
    zero: torch.Tensor
    """float32 [out, in / GROUP]."""

    def dequantize(self) -> torch.Tensor:
        out, inner = self.q.shape
        groups = (self.q.float() - 8).view(out, inner // GROUP, GROUP)
        return (groups * self.scale[..., None] + self.zero[..., None]).view(out, inner)


def gguf_q4_codes(raw: np.ndarray, kind: str, in_features: int) -> Int4Codes:
    """The codes of a GGUF Q4_0 or Q4_1 tensor: `raw` is its data as GGUFReader gives it, [out, bytes]
    uint8, each row `in_features / 32` blocks (float16 d, Q4_1 also float16 m, then 16 bytes: weight j
    of the block in the low nibble of byte j, weight j + 16 in its high nibble)."""
    if kind not in Q4_TYPES:
        raise ValueError(f"not a 4-bit GGUF type: {kind}")
    if in_features % GROUP:
        raise ValueError(f"{in_features} inputs are not whole blocks of {GROUP}")
    header = 2 if kind == "Q4_0" else 4
    blocks = in_features // GROUP
    rows = np.ascontiguousarray(raw).reshape(raw.shape[0], blocks, header + GROUP // 2)
    d = rows[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = rows[:, :, header:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(raw.shape[0], in_features)
    if kind == "Q4_1":
        m = rows[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    return Int4Codes(
        torch.from_numpy(q.astype(np.int32)),
        torch.from_numpy(d),
        torch.from_numpy(np.ascontiguousarray(zero)),
    )


def quantize_int4(weight: torch.Tensor) -> Int4Codes:
    """Asymmetric 4-bit codes of a float [out, in] weight, per group of 32 (min to max in 16 steps)."""
    out, inner = weight.shape
    groups = weight.float().view(out, inner // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return Int4Codes(q.view(out, inner), scale, low + 8 * scale)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 codes [out, in] and float32 scales [out]."""
    scale = (weight.float().abs().amax(1) / 127).clamp_min(1e-8)
    codes = (weight.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scale


def packable(layer: nn.Linear) -> bool:
    """The packed kernels take [out, in] weights with out a multiple of 16 and in of 32 (groups)."""
    return layer.out_features % 16 == 0 and layer.in_features % GROUP == 0


def _bucket(rows: int) -> int:
    for index, size in enumerate(ROW_BUCKETS):
        if rows <= size:
            return index
    return len(ROW_BUCKETS) - 1


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored quantized; `dense_for[bucket]` picks the dense bf16 matmul."""

    kind = ""
    packed = ""
    """The name of the buffer holding the quantized weight."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        """The model's activation dtype (inputs arrive and outputs leave in it)."""
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.dense: torch.Tensor | None = None
        """The dequantized weight in bfloat16, kept only while some row bucket runs dense."""
        self.dense_for = [False] * len(ROW_BUCKETS)

    @property
    def device(self) -> torch.device:
        return self.packed_weight().device

    def packed_weight(self) -> torch.Tensor:
        weight = getattr(self, self.packed)
        assert isinstance(weight, torch.Tensor)
        return weight

    def dequantized(self) -> torch.Tensor:
        """The weight as the kernel sees it, [out, in] in bfloat16 (computed through the kernel itself)."""
        eye = torch.eye(self.in_features, dtype=COMPUTE, device=self.device)
        return self.kernel(eye).T.contiguous()

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] in bfloat16 through the quantized kernel."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != COMPUTE:
            flat = flat.to(COMPUTE)
        if self.dense is not None and self.dense_for[_bucket(flat.shape[0])]:
            out = F.linear(flat, self.dense)
        else:
            out = self.kernel(flat)
        out = out.to(self.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class Int4Linear(QuantLinear):
    """4-bit weight, groups of 32, `_weight_int4pack_mm_for_cpu` on bfloat16 activations."""

    kind = "int4"
    packed = "weight_int4"

    def __init__(self, codes: Int4Codes, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out, inner = codes.q.shape
        super().__init__(inner, out, bias, dtype)
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.q, 1))
        scales_zeros = torch.stack([codes.scale.T, codes.zero.T], dim=-1)  # [in / GROUP, out, 2]
        self.register_buffer("scales_zeros", scales_zeros.to(COMPUTE).contiguous())

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == COMPUTE  # the float32 path is a scalar fallback: never
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.weight_int4, GROUP, self.scales_zeros
        )
        return out


class Int8Linear(QuantLinear):
    """8-bit weight, one scale per output channel, `_weight_int8pack_mm` on bfloat16 activations."""

    kind = "int8"
    packed = "weight_int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out, inner = weight.shape
        super().__init__(inner, out, bias, dtype)
        codes, scale = quantize_int8(weight)
        self.register_buffer("weight_int8", codes.contiguous())
        self.register_buffer("scales", scale.to(COMPUTE))

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)
        return out


FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 codes [out, in] and float32 scales [out] (one per output channel: amax -> 448)."""
    scale = (weight.float().abs().amax(1) / FP8_MAX).clamp_min(1e-12)
    return (weight.float() / scale[:, None]).to(FP8), scale


class Fp8Linear(QuantLinear):
    """float8 (e4m3) weight, one scale per output channel; each step's activations are quantized per row
    (dynamic, as vLLM's and torchao's rowwise FP8 do) and multiplied by `torch._scaled_mm`, which on CUDA
    runs the tensor cores' FP8 path (compute capability 8.9 and later: Ada, Hopper) and on CPU oneDNN's."""

    kind = "fp8"
    packed = "weight_fp8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out, inner = weight.shape
        super().__init__(inner, out, bias, dtype)
        codes, scale = quantize_fp8(weight)
        self.register_buffer("weight_fp8", codes.contiguous())
        self.register_buffer("weight_scale", scale[None, :].contiguous())  # [1, out]: rowwise for _scaled_mm

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x_scale = (x32.abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [rows, 1]
        weight, weight_scale = self.weight_fp8, self.weight_scale
        assert isinstance(weight, torch.Tensor) and isinstance(weight_scale, torch.Tensor)
        out: torch.Tensor = torch._scaled_mm(
            (x32 / x_scale).to(FP8),
            weight.t(),  # column-major [in, out], as _scaled_mm wants its second operand
            scale_a=x_scale,
            scale_b=weight_scale,
            out_dtype=COMPUTE,
        )
        return out


@dataclass
class QuantReport:
    """What `quantize_model` did, for the log and the engine's metadata."""

    layers: Counter[str] = field(default_factory=Counter)
    """Quantized layers by how: `int4 (GGUF Q4_1)`, `int4 (at load)`, `int8 (at load)`."""
    kept: Counter[str] = field(default_factory=Counter)
    """Layers left dense, by GGUF type (or `float`)."""

    @property
    def scheme(self) -> str:
        """`none`, or the kinds of quantized layers (`int4`, `int8`)."""
        kinds = sorted({how.split(" ")[0] for how in self.layers})
        return "+".join(kinds) if kinds else "none"

    def describe(self) -> str:
        done = ", ".join(f"{count} {how}" for how, count in sorted(self.layers.items()))
        kept = ", ".join(f"{count} {kind}" for kind, count in sorted(self.kept.items()))
        return f"quantized: {done or 'none'}; dense: {kept or 'none'}"


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The projections of the model body (not the head, not embeddings), by module name."""
    found: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            if name.split(".")[-1] in ("lm_head", "score", "classifier") or "embed" in name:
                continue
            found[name] = module
    return found


FP8_CAPABILITY = (8, 9)
"""CUDA compute capability from which `torch._scaled_mm` multiplies float8 (Ada, Hopper and later)."""


def cuda_capability(device: torch.device) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def _needs_bf16(requested: str, dtype: torch.dtype) -> None:
    if dtype != COMPUTE:
        raise ConfigError(
            f"model.quantization {requested} computes with bfloat16 activations, and model.dtype is "
            f"{str(dtype).removeprefix('torch.')}: set model.dtype to auto (on a GPU with bfloat16) "
            "or bfloat16"
        )


def resolve_mode(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    gguf: bool,
    capability: Callable[[torch.device], tuple[int, int]] = cuda_capability,
) -> tuple[str, str]:
    """`model.quantization` for this model and device: (`none` | `gguf4` | `int4` | `int8` | `fp8`, why)."""
    if requested == "none":
        return "none", "model.quantization none"
    if requested == "fp8":
        if device.type != "cuda":
            raise ConfigError(
                f"model.quantization fp8 needs a CUDA GPU of compute capability {FP8_CAPABILITY[0]}."
                f"{FP8_CAPABILITY[1]} or later (torch._scaled_mm's float8 path), not {device.type}"
            )
        found = capability(device)
        if found < FP8_CAPABILITY:
            raise ConfigError(
                f"model.quantization fp8 needs compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} "
                f"or later (Ada, Hopper); this GPU has {found[0]}.{found[1]}: use none"
            )
        _needs_bf16("fp8", dtype)
        return "fp8", f"model.quantization fp8 (compute capability {found[0]}.{found[1]})"
    if device.type != "cpu":
        if requested == "auto":
            return (
                "none",
                f"model.quantization auto: {device.type} keeps model.dtype (fp8 and int8 are opt-in there)",
            )
        if requested == "int8" and device.type == "cuda":
            _needs_bf16("int8", dtype)
            return "int8", "model.quantization int8 (weight-only, torch's CUDA int8 kernel)"
        raise ConfigError(
            f"model.quantization {requested} is served on CPU only (torch's packed CPU int4 kernel); on "
            f"{device.type} use none, int8 or fp8"
        )
    if requested in ("int4", "int8"):
        return requested, f"model.quantization {requested}"
    if not gguf:
        return "none", "model.quantization auto: not a GGUF checkpoint"
    if dtype != COMPUTE:
        return (
            "none",
            f"model.quantization auto: activations are {str(dtype).removeprefix('torch.')}, not bfloat16",
        )
    return "gguf4", "model.quantization auto: GGUF 4-bit layers kept in 4 bits"


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def quantize_model(model: nn.Module, mode: str, gguf_path: str | None, dtype: torch.dtype) -> QuantReport:
    """Replace the model body's linear layers as `mode` (`gguf4`: GGUF Q4 layers only, `int4`, `int8`,
    `fp8`) asks. The model's dense weights of replaced layers are dropped."""
    report = QuantReport()
    linears = linear_layers(model)
    gguf_codes: dict[str, Int4Codes] = {}
    gguf_types: dict[str, str] = {}
    if gguf_path and mode in ("gguf4", "int4"):
        gguf_codes, gguf_types, others = read_gguf_q4(model, gguf_path)
        report.kept.update(others)
    for name, layer in linears.items():
        bias = layer.bias
        replacement: QuantLinear | None = None
        if not packable(layer):
            report.kept[f"float ({layer.out_features}x{layer.in_features} does not pack)"] += 1
        elif name in gguf_codes:
            replacement = Int4Linear(gguf_codes[name], bias, dtype)
            report.layers[f"int4 (GGUF {gguf_types[name]})"] += 1
        elif mode == "int4":
            replacement = Int4Linear(quantize_int4(layer.weight.detach()), bias, dtype)
            report.layers["int4 (at load)"] += 1
        elif mode == "int8":
            replacement = Int8Linear(layer.weight.detach(), bias, dtype)
            report.layers["int8 (at load)"] += 1
        elif mode == "fp8":
            replacement = Fp8Linear(layer.weight.detach(), bias, dtype)
            report.layers["fp8 (at load)"] += 1
        elif mode != "gguf4" or not gguf_path:
            report.kept["float"] += 1
        if replacement is not None:
            _replace(model, name, replacement)
    return report


def read_gguf_q4(
    model: nn.Module, gguf_path: str
) -> tuple[dict[str, Int4Codes], dict[str, str], Counter[str]]:
    """The codes of the GGUF's Q4_0/Q4_1 linear layers by module name (rows in the order transformers
    loaded them: its tensor processor reorders Llama's q/k rows, and is applied here to the row indices),
    their GGUF types, and a count of the other linear layers' GGUF types (served dense)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config: Any = getattr(model, "config", None)
    arch = str(getattr(config, "model_type", ""))
    processor: Any = TENSOR_PROCESSORS.get(arch, TensorProcessor)(  # type: ignore[no-untyped-call]
        config=config.to_dict() if config else {}
    )
    names = get_gguf_hf_weights_map(model, processor)
    linears = linear_layers(model)
    codes: dict[str, Int4Codes] = {}
    types: dict[str, str] = {}
    others: Counter[str] = Counter()
    for tensor in GGUFReader(gguf_path).tensors:
        hf_name = names.get(tensor.name, "")
        module_name = hf_name.removesuffix(".weight")
        if not hf_name.endswith(".weight") or module_name not in linears:
            continue
        kind = tensor.tensor_type.name
        if kind not in Q4_TYPES:
            others[f"GGUF {kind}"] += 1
            continue
        layer = linears[module_name]
        found = gguf_q4_codes(np.asarray(tensor.data), kind, layer.in_features)
        order = processor.process(weights=np.arange(layer.out_features)[:, None], name=tensor.name).weights
        rows = torch.from_numpy(np.asarray(order).reshape(-1).astype(np.int64))
        codes[module_name] = Int4Codes(found.q[rows], found.scale[rows], found.zero[rows])
        types[module_name] = kind
    return codes, types, others


def best_of(run: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    """Seconds of the fastest of `repeats` calls (a CUDA device synchronised around each)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    best = float("inf")
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def choose_kernels(
    layers: Iterable[QuantLinear], buckets: Iterable[int] = ROW_BUCKETS
) -> dict[tuple[int, int, str], list[bool]]:
    """Time the quantized kernel against the dense bfloat16 matmul for each layer shape and row bucket;
    set each layer's `dense_for`, and keep its dense weight only where dense won a bucket. Returns
    {(out, in, kind): dense chosen per bucket}."""
    by_shape: dict[tuple[int, int, str], list[QuantLinear]] = {}
    for layer in layers:
        by_shape.setdefault((layer.out_features, layer.in_features, layer.kind), []).append(layer)
    sizes = list(buckets)
    choice: dict[tuple[int, int, str], list[bool]] = {}
    with torch.inference_mode():
        for key, members in by_shape.items():
            sample = members[0]
            dense = sample.dequantized()
            picks = []
            for rows in sizes:
                x = torch.randn(rows, sample.in_features, dtype=COMPUTE, device=sample.device)
                sample.kernel(x)
                F.linear(x, dense)
                packed_s = best_of(lambda: sample.kernel(x), sample.device)  # noqa: B023
                dense_s = best_of(lambda: F.linear(x, dense), sample.device)  # noqa: B023
                picks.append(dense_s < packed_s)
            choice[key] = picks
            for layer in members:
                layer.dense_for = picks
                layer.dense = layer.dequantized() if any(picks) else None
    return choice
