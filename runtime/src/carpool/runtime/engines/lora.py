"""LoRA adapters mixed in one forward pass: PEFT checkpoints read and checked, and the layers that apply them.

`LoraModel` wraps every projection of a decoder (each `nn.Linear` or GPT-2 style `Conv1D` under the
model body; `lm_head` and embeddings are left alone) in a `LoraLayer`. The base weights are never
touched: a layer runs the base projection, then adds the delta `x A_s B_s` of each adapter slot `s`
present in the step to that slot's rows. The adapters' weights are stacked per layer, `A: [slots, in,
max_rank]` and `B: [slots, max_rank, out]` (the scaling folded into B, zeros past an adapter's rank and
on layers it does not target, so a zero column adds exactly nothing).

A step lays every sequence's new tokens end to end (see `paged`). `LoraModel.set_rows` groups the rows
by slot once per step and picks one of two ways, as Punica and S-LoRA do with their kernels:

- **batched** (BGMV-like, the decode case: a few tokens per adapter): the rows of each slot are gathered
  into a `[slots, longest, in]` block, padded with copies of row 0 where a slot has fewer, and every
  layer does one gather, two `bmm`s over all the step's adapters and one scatter-add, whatever the
  number of adapters. The padding is computed and thrown away, so this is only chosen while it at most
  doubles the rows.
- **segments** (SGMV-like, long prompt chunks): per slot, its rows (a slice when contiguous) times its
  own A and B at its own rank.

A step that decodes many sequences and runs one prompt chunk does both: the decoding tokens in the
block, the chunk as a segment. Measured on SmolLM2-135M's shapes (16 decoding tokens over 8 adapters,
2 CPU threads): the block adds about 10-20% to the base forward pass, eight segments about 135%.

Layers that no adapter of the step targets, and steps with no adapter at all, cost one integer test.
Python runs per layer, never per token.

`read_adapter` reads a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) into host
tensors, checked against the base model's layers: a wrong base, a rank over the limit, missing files or
a feature carpool does not apply (DoRA, biases, replaced modules) raise `InvalidAdapter` naming why.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from carpool.runtime.config import ConfigError
from carpool.runtime.errors import InvalidAdapter
from carpool.runtime.sources import SourceKind, resolve_adapter_source

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")

MAX_PADDING = 2.0
"""The batched way is taken while the padded rows are at most this many times the real ones."""

SHORT_RUN = 2
"""Runs of up to this many rows (a decoding sequence's token) may go to the batched block."""

Rows = slice | torch.Tensor
"""The rows of a step one adapter runs on: a contiguous run, or their indices."""


@dataclass(frozen=True)
class LayerDelta:
    """One layer's LoRA factors on the host: `a` [rank, in], `b` [out, rank] already scaled."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class AdapterWeights:
    """A checked adapter, ready to copy into a slot."""

    name: str
    path: str
    rank: int
    """Its largest rank over the layers it targets."""
    layers: dict[str, LayerDelta]
    """By module name in the base model (`model.layers.0.self_attn.q_proj`)."""

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.b.nbytes for d in self.layers.values())


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _in_out(module: nn.Module) -> tuple[int, int]:
    weight = _weight(module)
    if isinstance(module, Conv1D):  # GPT-2 style: weight is [in, out]
        return int(weight.shape[0]), int(weight.shape[1])
    return int(weight.shape[1]), int(weight.shape[0])


def target_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The projections an adapter may target: linear layers of the model body, by module name."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | Conv1D) and not isinstance(module, LoraLayer):
            if name.split(".")[-1] in ("lm_head", "score", "classifier") or "embed" in name:
                continue
            found[name] = module
    return found


class _StepRows:
    """How the current forward pass's rows map to adapter slots (shared by every layer, set per step)."""

    def __init__(self) -> None:
        self.mask = 0
        """Bit `s` set when slot `s` has rows in this step; 0: no adapter, every layer is the base."""
        self.batched: _Batched | None = None
        self.segments: list[tuple[int, Rows]] = []


@dataclass(frozen=True)
class _Batched:
    slots: torch.Tensor | None
    """The step's slots in block order; None when they are 0..count-1 (views, no copy of A and B)."""
    count: int
    longest: int
    rank: int
    """The largest rank among the step's adapters: columns past it are zero for all of them."""
    gather: torch.Tensor
    """Row of the step for each place of the [count, longest] block (padding repeats row 0)."""
    keep: torch.Tensor | None
    """Places of the block that are real rows, in `rows` order; None when there is no padding."""
    rows: torch.Tensor
    """The step's row of each kept place."""


class LoraLayer(nn.Module):
    """A base projection plus the LoRA deltas of the adapters in the step, each on its own rows."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, base: nn.Module, slots: int, max_rank: int, state: _StepRows) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = _in_out(base)
        weight = _weight(base)
        dtype, device = weight.dtype, weight.device
        self.register_buffer(
            "lora_a", torch.zeros(slots, self.in_features, max_rank, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(slots, max_rank, self.out_features, dtype=dtype, device=device)
        )
        self.ranks = [0] * slots
        """Rank of each slot's adapter on this layer; 0 where it does not target it."""
        self.mask = 0
        """Bit `s` set when slot `s` holds an adapter that targets this layer."""
        self._state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        state = self._state
        if not state.mask & self.mask:
            return out
        flat_x = x.reshape(-1, self.in_features)
        flat_out = out.view(-1, self.out_features)
        batched = state.batched
        if batched is not None:
            n, rank = batched.count, batched.rank
            if batched.slots is None:
                a, b = self.lora_a[:n, :, :rank], self.lora_b[:n, :rank]
            else:
                a = self.lora_a.index_select(0, batched.slots)[:, :, :rank]
                b = self.lora_b.index_select(0, batched.slots)[:, :rank]
            block = flat_x.index_select(0, batched.gather).view(n, batched.longest, self.in_features)
            delta = torch.bmm(torch.bmm(block, a), b).view(-1, self.out_features)
            if batched.keep is not None:
                delta = delta.index_select(0, batched.keep)
            flat_out.index_add_(0, batched.rows, delta)
        for slot, rows in state.segments:
            rank = self.ranks[slot]
            if rank == 0:
                continue
            a, b = self.lora_a[slot, :, :rank], self.lora_b[slot, :rank]
            if isinstance(rows, slice):
                flat_out[rows] += (flat_x[rows] @ a) @ b
            else:
                flat_out.index_add_(0, rows, (flat_x.index_select(0, rows) @ a) @ b)
        return out


class LoraModel:
    """Installs `LoraLayer`s in a model and fills their slots; the engine's one handle on LoRA.

    Called from the model thread only (`write`, `set_rows`, the forward pass); `read` from any thread.
    """

    def __init__(self, model: nn.Module, slots: int, max_rank: int) -> None:
        if slots < 1:
            raise ValueError(f"LoRA needs at least one slot, got {slots}")
        self.slots = slots
        self.max_rank = max_rank
        self._state = _StepRows()
        self.layers: dict[str, LoraLayer] = {}
        for name, module in target_layers(model).items():
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = LoraLayer(module, slots, max_rank, self._state)
            setattr(parent, attr, layer)
            self.layers[name] = layer
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no linear projections an adapter could target")
        first = next(iter(self.layers.values()))
        self.dtype = first.lora_a.dtype
        self.device = first.lora_a.device
        self.shapes = {name: (layer.in_features, layer.out_features) for name, layer in self.layers.items()}
        self.name_or_path = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        self.slot_ranks = [0] * slots
        """The largest rank of each slot's adapter (0: empty)."""
        self.slot_of: dict[int, int] = {}
        """Slot of each sequence of the next step that uses an adapter, by sequence id."""

    # -- slots ----------------------------------------------------------------------------------

    def read(self, name: str, source: str) -> AdapterWeights:
        """Resolve and read an adapter's files, checked against this model (slow: off the busy loop)."""
        return read_adapter(name, adapter_folder(source), self)

    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Copy `adapter` into `slot`, replacing what was there. Layers it does not target add nothing."""
        bit = 1 << slot
        for name, layer in self.layers.items():
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
            delta = adapter.layers.get(name)
            if delta is None:
                layer.ranks[slot] = 0
                layer.mask &= ~bit
                continue
            rank = delta.rank
            layer.lora_a[slot, :, :rank].copy_(delta.a.T, non_blocking=True)
            layer.lora_b[slot, :rank].copy_(delta.b.T, non_blocking=True)
            layer.ranks[slot] = rank
            layer.mask |= bit
        self.slot_ranks[slot] = adapter.rank

    def prepare(self, loads: list[tuple[int, Any]], slot_of: dict[int, int]) -> None:
        """Before a step: copy newly placed adapters into their slots, and note each sequence's slot."""
        for slot, weights in loads:
            self.write(slot, weights)
        self.slot_of = slot_of

    # -- rows of a step -------------------------------------------------------------------------

    def set_rows(self, runs: list[tuple[int, int, int]]) -> None:
        """Set the rows of the next forward pass: (first row, row count, slot) per run of tokens.

        Short runs (decoding sequences) go to the batched block when it has several slots and little
        padding; long runs (prompt chunks), and short ones otherwise, to per-slot segments."""
        state = self._state
        state.batched, state.segments = None, []
        runs = [run for run in runs if run[1] > 0]
        state.mask = 0
        for _, _, slot in runs:
            state.mask |= 1 << slot
        if not runs:
            return
        short = [run for run in runs if run[1] <= SHORT_RUN]
        long = [run for run in runs if run[1] > SHORT_RUN]
        if short:
            spans = _spans(short)
            sizes = [sum(b - a for a, b in s) for s in spans.values()]
            if len(spans) > 1 and len(spans) * max(sizes) <= MAX_PADDING * sum(sizes):
                state.batched = self._batched(spans, max(sizes), sum(sizes))
            else:
                long = runs
        for slot, slot_spans in _spans(long).items():
            if len(slot_spans) == 1:
                state.segments.append((slot, slice(*slot_spans[0])))
            else:
                index = torch.cat([torch.arange(a, b) for a, b in slot_spans])
                state.segments.append((slot, index.to(self.device, non_blocking=True)))

    def _batched(self, spans: dict[int, list[tuple[int, int]]], longest: int, total: int) -> _Batched:
        order = sorted(spans)
        gather: list[int] = []
        keep: list[int] = []
        rows: list[int] = []
        for index, slot in enumerate(order):
            mine = [row for a, b in spans[slot] for row in range(a, b)]
            keep.extend(range(index * longest, index * longest + len(mine)))
            rows.extend(mine)
            gather.extend(mine + [0] * (longest - len(mine)))
        padded = len(order) * longest != total
        device = self.device
        return _Batched(
            slots=None if order == list(range(len(order))) else torch.tensor(order, device=device),
            count=len(order),
            longest=longest,
            rank=max(self.slot_ranks[slot] for slot in order) or 1,
            gather=torch.tensor(gather, device=device),
            keep=torch.tensor(keep, device=device) if padded else None,
            rows=torch.tensor(rows, device=device),
        )

    def clear_rows(self) -> None:
        self._state.mask = 0
        self._state.batched = None
        self._state.segments = []


def _spans(runs: list[tuple[int, int, int]]) -> dict[int, list[tuple[int, int]]]:
    """(start, stop) row spans per slot, adjacent runs of one slot merged."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for start, count, slot in runs:
        of_slot = spans.setdefault(slot, [])
        if of_slot and of_slot[-1][1] == start:
            of_slot[-1] = (of_slot[-1][0], start + count)
        else:
            of_slot.append((start, start + count))
    return spans


# -- reading PEFT checkpoints ---------------------------------------------------------------------


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module by name suffix or as a regex."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def _check_config(config: dict[str, Any], name: str) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise InvalidAdapter(f"adapter {name!r} is a {peft_type} adapter; only LoRA is served")
    refused = {
        "use_dora": "DoRA (use_dora) is not supported",
        "lora_bias": "LoRA biases (lora_bias) are not supported",
        "modules_to_save": f"modules_to_save {config.get('modules_to_save')} replaces whole base modules",
        "trainable_token_indices": "trainable tokens (trainable_token_indices) are not supported",
        "target_parameters": "target_parameters (LoRA on parameters) is not supported",
        "layer_replication": "layer_replication changes the base model's layers",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
        "use_qalora": "QA-LoRA (use_qalora) is not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise InvalidAdapter(f"adapter {name!r}: {why}")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise InvalidAdapter(
            f"adapter {name!r}: bias {bias!r} trains base biases; only bias 'none' is served"
        )


def read_adapter(name: str, path: str, lora: LoraModel) -> AdapterWeights:
    """Read and check a PEFT LoRA folder against the base model's layers; host tensors in its dtype."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidAdapter(f"adapter {name!r}: {path} is not a folder")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise InvalidAdapter(f"adapter {name!r}: {path} has no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidAdapter(f"adapter {name!r}: cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidAdapter(f"adapter {name!r}: {config_path} must hold a JSON object")
    _check_config(config, name)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        legacy = (
            " (only the pickled adapter_model.bin, which is not loaded)"
            if (folder / LEGACY_WEIGHTS_FILE).is_file()
            else ""
        )
        raise InvalidAdapter(f"adapter {name!r}: {path} has no {WEIGHTS_FILE}{legacy}")
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise InvalidAdapter(f"adapter {name!r}: cannot read {weights_path}: {exc}") from exc

    base_name = config.get("base_model_name_or_path")
    if base_name and lora.name_or_path and Path(str(base_name)).name != Path(lora.name_or_path).name:
        # The same base has many names (hub id, local folder, GGUF file); the layer shapes below decide.
        log.warning(
            "adapter %r was trained on %r; serving it on %r since every layer it targets fits",
            name,
            base_name,
            lora.name_or_path,
        )
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            kind = "embedding LoRA" if "lora_embedding" in key else "a tensor LoRA does not hold"
            raise InvalidAdapter(f"adapter {name!r}: {key} is {kind}; not supported")
        module = match["module"].removeprefix(_PREFIX)
        factors.setdefault(module, {})[match["part"]] = tensor
    if not factors:
        raise InvalidAdapter(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")

    default_rank = int(config.get("r", 8))
    default_alpha = float(config.get("lora_alpha", default_rank))
    rslora = bool(config.get("use_rslora", False))
    layers: dict[str, LayerDelta] = {}
    for module, parts in sorted(factors.items()):
        if module not in lora.shapes:
            raise InvalidAdapter(
                f"adapter {name!r} targets {module}, which is not a linear layer of this base model: "
                "trained for another model?"
            )
        if set(parts) != {"A", "B"}:
            raise InvalidAdapter(f"adapter {name!r}: {module} has lora_{''.join(parts)} but not both A and B")
        a, b = parts["A"], parts["B"]
        fan_in, fan_out = lora.shapes[module]
        rank = int(a.shape[0])
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
            raise InvalidAdapter(
                f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but the base "
                f"layer maps {fan_in} -> {fan_out} (A must be [r, {fan_in}], B [{fan_out}, r]): "
                "trained for another base model"
            )
        if rank > lora.max_rank:
            raise InvalidAdapter(
                f"adapter {name!r} has rank {rank} on {module}, over this server's limit of "
                f"{lora.max_rank} (lora.max_rank)"
            )
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, default_alpha))
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        dtype = lora.dtype
        layers[module] = LayerDelta(a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
    return AdapterWeights(name, str(folder), max(d.rank for d in layers.values()), layers)


def adapter_folder(source: str) -> str:
    """The local folder of an adapter source; a hub id is downloaded (where a hub is reachable)."""
    try:
        resolved = resolve_adapter_source(source)
    except ConfigError as exc:
        raise InvalidAdapter(str(exc)) from exc
    if resolved.kind is not SourceKind.HUB:
        return resolved.location
    from huggingface_hub import snapshot_download

    try:
        return str(snapshot_download(resolved.location, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
    except Exception as exc:  # offline, unknown repo, no access: the caller's to fix
        raise InvalidAdapter(f"LoRA adapter {source!r}: cannot download it from the hub: {exc}") from exc
