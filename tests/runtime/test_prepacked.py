"""Encoder projections with oneDNN-prepacked weights on the CPU (`models.prepacked`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel

from carpool.runtime.models import prepacked
from carpool.runtime.models.prepacked import ALL_ROWS, PrepackedLinear, install, packed_rows_from

pytestmark = pytest.mark.skipif(
    not prepacked.available(),
    reason="this torch build has no oneDNN prepacked linear kernel, so projections are never packed on it",
)


def _bert(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    model: nn.Module = BertModel(config)
    return model.to(dtype).eval()


def _timer(packed_wins_up_to: int) -> Callable[[Callable[[], object]], float]:
    """A stand-in for the wall clock (this host's timings are not what the test is about): `install` times
    the plain projections, then the packed ones, at each of `prepacked.ROWS` in order; the packed ones
    win up to `packed_wins_up_to` rows."""
    calls: list[int] = []

    def timer(run: Callable[[], object]) -> float:
        run()
        index = len(calls)
        calls.append(index)
        if index % 2 == 0:
            return 1.0
        return 0.5 if prepacked.ROWS[index // 2] <= packed_wins_up_to else 2.0

    return timer


PACKED_DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not prepacked.packs(torch.bfloat16),
            reason="oneDNN packs no bfloat16 weights on this CPU (no AVX512-BW/VL/DQ or AVX-NE-CONVERT): "
            "install leaves such a model plain (test_install_leaves_a_dtype_this_cpu_cannot_pack_plain)",
        ),
    ),
]


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (1, 17, 64), (2, 40, 64), (700, 64)])
def test_a_prepacked_projection_gives_the_plain_projections_output(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(1)
    linear = nn.Linear(64, 96).to(dtype).eval()
    x = torch.randn(*shape, dtype=dtype)
    with torch.inference_mode():
        expected = linear(x).float()
        for rows in (ALL_ROWS, 32):  # packed for everything; packed up to 32 rows, the plain weight above
            got = PrepackedLinear(linear, rows)(x)
            assert got.shape == expected.shape and got.dtype == dtype
            error = float((got.float() - expected).abs().max() / expected.abs().max())
            assert error <= prepacked.TOLERANCE[dtype], (rows, error)


def test_the_packed_kernel_runs_up_to_its_row_count_and_the_plain_weight_above() -> None:
    linear = nn.Linear(8, 8).eval()
    layer = PrepackedLinear(linear, packed_rows=4)
    calls: list[str] = []
    original = torch.ops.mkldnn._linear_pointwise

    def spy(*args: object) -> torch.Tensor:
        calls.append("packed")
        return original(*args)  # type: ignore[no-any-return]

    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy, raising=False)
        layer(torch.randn(4, 8))
        layer(torch.randn(1, 4, 8))
        layer(torch.randn(5, 8))
    assert calls == ["packed", "packed"]


def test_the_row_count_is_where_packing_won_at_every_smaller_count() -> None:
    rows = (8, 32, 128)
    assert packed_rows_from([1, 1, 1], [0.5, 0.5, 0.5], rows) == ALL_ROWS
    assert packed_rows_from([1, 1, 1], [0.5, 0.5, 2.0], rows) == 32
    assert packed_rows_from([1, 1, 1], [0.5, 2.0, 0.5], rows) == 8  # a loss in between ends it
    assert packed_rows_from([1, 1, 1], [2.0, 0.5, 0.5], rows) == 0
    assert packed_rows_from([1, 1, 1], [1.0, 0.5, 0.5], rows) == 0  # a tie is not a win


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_install_packs_every_projection_and_the_encoder_gives_the_same_states(dtype: torch.dtype) -> None:
    model, reference = _bert(dtype), _bert(dtype)
    ids = torch.randint(5, 300, (2, 23))
    with torch.inference_mode():
        choice = install(model, timer=_timer(packed_wins_up_to=1 << 30))
        got = model(input_ids=ids).last_hidden_state.float()
        expected = reference(input_ids=ids).last_hidden_state.float()
    layers = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    assert choice.packed_rows == ALL_ROWS and choice.layers == len(layers) == 2 * 6 + 1  # + the pooler
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # Packed everywhere: the plain weights are released, no memory is added.
    assert choice.extra_bytes == 0 and all(layer.weight is None for layer in layers)
    assert float((got - expected).abs().max() / expected.abs().max()) <= prepacked.TOLERANCE[dtype]
    assert "13 layers packed for every batch, no more memory" in prepacked.describe(choice)


def test_install_leaves_a_dtype_this_cpu_cannot_pack_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    # As bfloat16 on a CPU without AVX512-BW/VL/DQ or AVX-NE-CONVERT, where oneDNN's reorder raises: the
    # model keeps its plain projections and serves (a model.dtype bfloat16 pod must not fail its start).
    def refuse(*args: object) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...")

    prepacked.packs.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    try:
        model, reference = _bert(torch.bfloat16), _bert(torch.bfloat16)
        choice = install(model, timer=_timer(packed_wins_up_to=1 << 30))
        assert choice.packed_rows == 0 and "packs no torch.bfloat16 weights" in choice.reason
        assert not any(isinstance(m, PrepackedLinear) for m in model.modules())
        ids = torch.randint(5, 300, (2, 23))
        with torch.inference_mode():
            assert torch.equal(
                model(input_ids=ids).last_hidden_state, reference(input_ids=ids).last_hidden_state
            )
    finally:
        prepacked.packs.cache_clear()


def test_install_keeps_the_plain_weights_where_packing_lost_at_large_batches() -> None:
    model = _bert(torch.float32)
    choice = install(model, timer=_timer(packed_wins_up_to=128))
    layers = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    assert choice.packed_rows == 128 and all(layer.packed_rows == 128 for layer in layers)
    assert all(layer.weight is not None for layer in layers)
    weights = sum(layer.weight.numel() * 4 for layer in layers if layer.weight is not None)
    assert choice.extra_bytes == weights
    assert "batches of up to 128 tokens" in prepacked.describe(choice)


def test_install_changes_nothing_where_the_plain_kernel_won() -> None:
    model = _bert(torch.float32)
    choice = install(model, timer=_timer(packed_wins_up_to=0))
    assert choice.packed_rows == 0
    assert not any(isinstance(m, PrepackedLinear) for m in model.modules())
    assert "off (the plain kernel was as fast" in prepacked.describe(choice)


class _ReadsItsWeight(nn.Module):
    """A model whose own code reads a projection's `weight` (as some remote-code models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        states = torch.ones(input_ids.shape[-1], 16)
        return (states @ self.proj.weight.t() + self.proj(states),)


class _Shifted(nn.Module):
    """A model the probe sees differ once packed (a stand-in for a kernel that computes wrong here)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        states = self.proj(torch.ones(input_ids.shape[-1], 16))
        return (states + (1.0 if isinstance(self.proj, PrepackedLinear) else 0.0),)


@pytest.mark.parametrize("model", [_ReadsItsWeight, _Shifted])
def test_a_model_the_probe_finds_broken_or_different_once_packed_keeps_its_plain_projections(
    model: type[nn.Module],
) -> None:
    built = model().eval()
    linear = built.proj
    choice = install(built, timer=_timer(packed_wins_up_to=1 << 30), probe=prepacked.probe_forward(built))
    assert choice.packed_rows == 0 and built.proj is linear
    assert "the packed model" in prepacked.describe(choice)
    with torch.inference_mode():
        built(torch.arange(1, 9).unsqueeze(0))  # serves as before


def test_the_probe_passes_a_real_encoder_and_it_is_packed() -> None:
    model = _bert(torch.float32)
    choice = install(model, timer=_timer(packed_wins_up_to=1 << 30), probe=prepacked.probe_forward(model))
    assert choice.packed_rows == ALL_ROWS and not choice.reason
