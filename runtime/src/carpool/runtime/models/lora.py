"""LoRA adapters mixed in one forward pass: PEFT checkpoints read and checked, and the layers that apply them.

`LoraModel` wraps every projection of a decoder (each `nn.Linear`, GPT-2 style `Conv1D` or quantized
`quant.QuantLinear` under the model body; `lm_head` and embeddings are left alone) in a `LoraLayer`. The
base weights are never touched: a layer runs the base projection, then adds the delta `x A_s B_s` of each
adapter slot `s` present in the step to that slot's rows. The adapters' weights are stacked, `A: [slots,
in, max_rank]` and `B: [slots, max_rank, out]` (the scaling folded into B, zeros past an adapter's rank
and on layers it does not target, so a zero column adds exactly nothing). Projections that read one input
(q/k/v, gate/up: `FUSED_SHRINK`) keep their A side by side and share one `x A` per step, as vLLM's merged
qkv and gate-up LoRA layers do.

A step lays every sequence's new tokens end to end (see `paged`), in the order `order` gives: base
sequences, each adapter's decoding tokens side by side in slot order, then prompt chunks.
`LoraModel.set_rows` groups the rows by slot once per step and picks one of two ways, as Punica and
S-LoRA do with their kernels:

- **batched** (BGMV-like, the decode case: a few tokens per adapter): the rows of each slot form a
  `[slots, longest, in]` block and every layer does two `bmm`s over all the step's adapters, whatever
  their number. When every slot has the same number of rows, laid side by side, the block is a view of
  the step's rows and the delta is added in place (`baddbmm_`); otherwise the rows are gathered,
  padded with zero rows, and added back with `index_add_`. Padding is computed and thrown away, so this
  way is only chosen while it at most doubles the rows.
- **segments** (SGMV-like, long prompt chunks): per slot, its rows (a slice when contiguous) times its
  own A and B at its own rank.

A step that decodes many sequences and runs one prompt chunk does both: the decoding tokens in the
block, the chunk as a segment. On a CPU these products are tiny and their cost is the number of
operator calls, which is what the view, the in-place add and the shared `x A` cut.

Layers that no adapter of the step targets, and steps with no adapter at all, cost one integer test.
Python runs per layer, never per token. A `LoraModel` is made after the model is on its device.

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
from carpool.runtime.models.quant import QuantLinear
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
    """The layer's weight, or for a quantized layer an empty tensor of its activation dtype and device."""
    if isinstance(module, QuantLinear):
        return torch.empty(0, dtype=module.dtype, device=module.device)
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _in_out(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, QuantLinear):
        return module.in_features, module.out_features
    weight = _weight(module)
    if isinstance(module, Conv1D):  # GPT-2 style: weight is [in, out]
        return int(weight.shape[0]), int(weight.shape[1])
    return int(weight.shape[1]), int(weight.shape[0])


def target_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The projections an adapter may target: linear layers of the model body, by module name."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | Conv1D | QuantLinear) and not isinstance(module, LoraLayer):
            if name.split(".")[-1] in ("lm_head", "score", "classifier") or "embed" in name:
                continue
            found[name] = module
    return found


FUSED_SHRINK = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
    frozenset({"query", "key", "value"}),
)
"""Sibling projections that read one input (Llama-family attention and MLP, BERT attention): their `x A`
is one product, as vLLM's merged qkv and gate-up LoRA layers do."""


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
    start: int | None
    """Set when the block is the step's rows `start : start + count * longest` as they lie (every slot
    has `longest` rows, one after the other in slot order): no gather, and the delta is added in place."""
    gather: torch.Tensor | None
    """Otherwise: the step's row of each place of the [count, longest] block (padding repeats a real row
    of the slot, and adds exactly zero back to it)."""
    pad: torch.Tensor | None
    """[count, longest, 1]: 1 for real places, 0 for padding; None when nothing is padded."""


class _Shrink:
    """`x A` for the projections of one input: the A of each member side by side, computed once per step.

    A is `[slots, in, members * max_rank]`, member `m`'s in columns `m * max_rank` on. The first member
    called with an input computes every member's product; the others reuse it when they are called
    with the very same tensor (a model that fed them different inputs would get one product each), and
    the last one drops it. One matmul over the members' columns when that reads at most twice the
    columns the step's rank needs (adapters of rank near `max_rank`), else one per member.
    """

    def __init__(self, in_features: int, slots: int, max_rank: int, members: int, like: torch.Tensor) -> None:
        self.in_features = in_features
        self.max_rank = max_rank
        self.members = members
        self.lora_a = torch.zeros(
            slots, in_features, members * max_rank, dtype=like.dtype, device=like.device
        )
        self.layers: list[LoraLayer] = []
        self.ranks = [0] * slots
        """Largest rank of each slot's adapter over the members."""
        self._input: torch.Tensor | None = None
        self._block: list[torch.Tensor | None] = []
        self._segments: list[list[torch.Tensor | None] | None] = []
        self._users = 0

    def a_of(self, member: int) -> torch.Tensor:
        """One member's A, `[slots, in, max_rank]`, a view to write into."""
        return self.lora_a[:, :, member * self.max_rank : (member + 1) * self.max_rank]

    def refresh(self, slot: int) -> None:
        self.ranks[slot] = max(layer.ranks[slot] for layer in self.layers)

    def product(
        self, x: torch.Tensor, state: _StepRows
    ) -> tuple[list[torch.Tensor | None], list[list[torch.Tensor | None] | None]]:
        """`x A` of this step for each member: in the batched block `[count, longest, rank]`, and per
        segment `[rows, rank_s]` (the segment None where its slot targets no member)."""
        if x is self._input:
            cached = self._block, self._segments
            self._users -= 1
            if self._users <= 0:
                self.drop()
            return cached
        users = [layer.member for layer in self.layers if state.mask & layer.mask]
        flat = x.reshape(-1, self.in_features)
        block: list[torch.Tensor | None] = []
        batched = state.batched
        if batched is not None:
            n = batched.count
            a = self.lora_a[:n] if batched.slots is None else self.lora_a.index_select(0, batched.slots)
            if batched.start is not None:
                rows = flat[batched.start : batched.start + n * batched.longest]
            else:
                assert batched.gather is not None
                rows = flat.index_select(0, batched.gather)
            view = rows.view(n, batched.longest, self.in_features)
            block = self._times(view, a, batched.rank, users, batched.pad)
        segments: list[list[torch.Tensor | None] | None] = []
        for slot, rows_of in state.segments:
            rank = self.ranks[slot]
            if rank == 0:
                segments.append(None)
                continue
            mine = flat[rows_of] if isinstance(rows_of, slice) else flat.index_select(0, rows_of)
            segments.append(self._times(mine, self.lora_a[slot], rank, users))
        if len(users) > 1:
            self._input, self._block, self._segments, self._users = x, block, segments, len(users) - 1
        return block, segments

    def _times(
        self, x: torch.Tensor, a: torch.Tensor, rank: int, users: list[int], pad: torch.Tensor | None = None
    ) -> list[torch.Tensor | None]:
        """Each member's `x A[..., :rank]` (None for members the step does not use), times `pad`."""
        width = self.max_rank
        if self.members == 1 or (self.members - 1) * (width - rank) <= self.members * rank:
            both = x @ a[..., : (self.members - 1) * width + rank]
            if pad is not None:
                both.mul_(pad)
            return [both[..., m * width : m * width + rank] for m in range(self.members)]
        products: list[torch.Tensor | None] = [None] * self.members
        for m in users:
            product = x @ a[..., m * width : m * width + rank]
            products[m] = product if pad is None else product.mul_(pad)
        return products

    def drop(self) -> None:
        self._input, self._block, self._segments, self._users = None, [], [], 0


class LoraLayer(nn.Module):
    """A base projection plus the LoRA deltas of the adapters in the step, each on its own rows."""

    lora_b: torch.Tensor

    def __init__(self, base: nn.Module, slots: int, max_rank: int, state: _StepRows, shrink: _Shrink) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = _in_out(base)
        weight = _weight(base)
        self.register_buffer(
            "lora_b",
            torch.zeros(slots, max_rank, self.out_features, dtype=weight.dtype, device=weight.device),
        )
        self.shrink = shrink
        self.member = len(shrink.layers)
        shrink.layers.append(self)
        self.ranks = [0] * slots
        """Rank of each slot's adapter on this layer; 0 where it does not target it."""
        self.mask = 0
        """Bit `s` set when slot `s` holds an adapter that targets this layer."""
        self._state = state

    @property
    def lora_a(self) -> torch.Tensor:
        """This layer's A, `[slots, in, max_rank]` (a view of its input's shared A)."""
        return self.shrink.a_of(self.member)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        state = self._state
        if not state.mask & self.mask:
            return out
        block, segments = self.shrink.product(x, state)
        flat_out = out.view(-1, self.out_features)
        batched = state.batched
        if batched is not None:
            own = block[self.member]
            assert own is not None
            n, rank = batched.count, batched.rank
            b = (
                self.lora_b[:n, :rank]
                if batched.slots is None
                else self.lora_b[:, :rank].index_select(0, batched.slots)
            )
            if batched.start is not None:
                place = flat_out[batched.start : batched.start + n * batched.longest]
                place.view(n, batched.longest, self.out_features).baddbmm_(own, b)
            else:
                assert batched.gather is not None
                flat_out.index_add_(0, batched.gather, torch.bmm(own, b).view(-1, self.out_features))
        for (slot, rows), products in zip(state.segments, segments, strict=True):
            if products is None or self.ranks[slot] == 0:
                continue
            own, b = products[self.member], self.lora_b[slot, : self.shrink.ranks[slot]]
            assert own is not None
            if isinstance(rows, slice):
                flat_out[rows].addmm_(own, b)
            else:
                flat_out.index_add_(0, rows, own @ b)
        return out


def _shrink_groups(found: dict[str, nn.Module]) -> list[list[str]]:
    """The projections to wrap, grouped by shared input: FUSED_SHRINK siblings of one parent (with the
    same input width) together, every other projection alone."""
    families: dict[tuple[str, int, int], list[str]] = {}
    groups: list[list[str]] = []
    for name, module in found.items():
        parent, _, attr = name.rpartition(".")
        family = next((i for i, names in enumerate(FUSED_SHRINK) if attr in names), None)
        if family is None:
            groups.append([name])
            continue
        key = (parent, family, _in_out(module)[0])
        if key not in families:
            families[key] = []
            groups.append(families[key])
        families[key].append(name)
    return groups


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
        self._shrinks: list[_Shrink] = []
        found = target_layers(model)
        for group in _shrink_groups(found):
            first = found[group[0]]
            shrink = _Shrink(_in_out(first)[0], slots, max_rank, len(group), _weight(first))
            self._shrinks.append(shrink)
            for name in group:
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                layer = LoraLayer(found[name], slots, max_rank, self._state, shrink)
                setattr(parent, attr, layer)
                self.layers[name] = layer
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no linear projections an adapter could target")
        first_layer = next(iter(self.layers.values()))
        self.dtype = first_layer.lora_b.dtype
        self.device = first_layer.lora_b.device
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
            a = layer.lora_a
            a[slot].zero_()
            layer.lora_b[slot].zero_()
            delta = adapter.layers.get(name)
            if delta is None:
                layer.ranks[slot] = 0
                layer.mask &= ~bit
                continue
            rank = delta.rank
            a[slot, :, :rank].copy_(delta.a.T, non_blocking=True)
            layer.lora_b[slot, :rank].copy_(delta.b.T, non_blocking=True)
            layer.ranks[slot] = rank
            layer.mask |= bit
        for shrink in self._shrinks:
            shrink.refresh(slot)
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
        padding; long runs (prompt chunks), and short ones otherwise, to per-slot segments. The block
        is cheapest when the short runs lie in slot order, the same number per slot, one after the
        other (`order` puts them so): then it is a view of the step's rows."""
        self.clear_rows()
        state = self._state
        runs = [run for run in runs if run[1] > 0]
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
                state.batched = self._batched(spans, max(sizes))
            else:
                long = runs
        for slot, slot_spans in _spans(long).items():
            if len(slot_spans) == 1:
                state.segments.append((slot, slice(*slot_spans[0])))
            else:
                index = torch.cat([torch.arange(a, b) for a, b in slot_spans])
                state.segments.append((slot, index.to(self.device, non_blocking=True)))

    def _batched(self, spans: dict[int, list[tuple[int, int]]], longest: int) -> _Batched:
        order = sorted(spans)
        device = self.device
        slots = None if order == list(range(len(order))) else torch.tensor(order, device=device)
        rank = max(self.slot_ranks[slot] for slot in order) or 1
        first = spans[order[0]][0][0]
        if all(
            spans[slot] == [(first + i * longest, first + (i + 1) * longest)] for i, slot in enumerate(order)
        ):
            return _Batched(slots, len(order), longest, rank, first, None, None)
        gather: list[int] = []
        real: list[bool] = []
        for slot in order:
            mine = [row for a, b in spans[slot] for row in range(a, b)]
            gather.extend(mine + [mine[0]] * (longest - len(mine)))
            real.extend([True] * len(mine) + [False] * (longest - len(mine)))
        pad = None
        if not all(real):
            pad = (
                torch.tensor(real, dtype=self.dtype)
                .view(len(order), longest, 1)
                .to(device, non_blocking=True)
            )
        return _Batched(slots, len(order), longest, rank, None, torch.tensor(gather, device=device), pad)

    def clear_rows(self) -> None:
        self._state.mask = 0
        self._state.batched = None
        self._state.segments = []
        for shrink in self._shrinks:
            shrink.drop()


def order(runs: list[tuple[int, int | None]]) -> list[int]:
    """The order to lay a step's sequences out in, given (token count, slot or None for the base model)
    of each: base sequences first, then decoding ones by slot, then prompt chunks by slot (stable), so
    each adapter's decoding tokens are side by side and the batched block is a view when it can be."""
    return sorted(
        range(len(runs)),
        key=lambda i: (0, 0) if runs[i][1] is None else (1 if runs[i][0] <= SHORT_RUN else 2, runs[i][1]),
    )


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
