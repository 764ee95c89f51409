"""carpool's rules around vLLM's engine (`vllm.core.VllmCore`), driven by a scripted backend in place of
vLLM (its real engine runs in tests/vllm, with the packaged SmolLM2): what reaches vLLM and when, what
comes back to the fronts, and what carpool still decides itself (queue bound, deadlines, priorities,
adapter names). No event loop, no sleeps: the clock is a variable."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.runtime.batching.saturation import BatchLimits
from carpool.runtime.config import ConfigError, DType, EngineKind
from carpool.runtime.engine.tasks import Output
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.vllm.args import ModelFacts, engine_args, resolve_dtype, vllm_priority
from carpool.runtime.vllm.core import Add, Control, Delta, Stats, StepResult, VllmCore
from carpool.runtime.vllm.launch import Probe, choose, find_python
from carpool.runtime.wire import (
    Abort,
    AdapterDone,
    EngineInfo,
    ErrorOutput,
    GenerateRequest,
    LoadAdapter,
    TextSpec,
    TokenLogprobs,
    TokenOutput,
    VllmOutputs,
    VllmRequest,
)

from .factories import runtime_config

EOS = 2


@dataclass
class ScriptedVllm:
    """Stands in for vLLM's engine core: every step gives each request it holds the next id of its
    script, and reports its scheduler the way vLLM's stats do."""

    script: list[int] = field(default_factory=lambda: [11, 12, 13, EOS])
    held: dict[str, int] = field(default_factory=dict)
    """request id -> tokens given so far."""
    added: list[Add] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    controls: list[Control] = field(default_factory=list)
    capacity: int = 16
    refuse: dict[str, str] = field(default_factory=dict)
    """request id -> the reason vLLM's input validation gives when it is added."""
    surface_gone: bool = False
    serving: bool = False
    """`begin_serving` was called: the warm-up is over."""
    runs_while_serving: list[bool] = field(default_factory=list)
    preempt: int = 0
    """Preemptions vLLM reports at each step (its PREEMPTED events)."""
    scheduled: set[str] = field(default_factory=set)
    prepared: list[str] = field(default_factory=list)
    """Request ids prepared as they arrived (`prepare`), in order."""
    step_cost: tuple[float, float] | None = None
    """(seconds a step, seconds a computed token): each step moves `clock` on by its cost."""
    clock: list[float] = field(default_factory=lambda: [0.0])

    @property
    def info(self) -> EngineInfo:
        return EngineInfo("smol", "generate", 2048, "cpu", "bfloat16", "fake", engine="vllm test")  # type: ignore[arg-type]

    def text_spec(self) -> TextSpec:
        return TextSpec("{}")

    @property
    def eos_ids(self) -> set[int]:
        return {EOS}

    @property
    def limits(self) -> BatchLimits:
        return BatchLimits(self.capacity, 2048)

    def has_work(self) -> bool:
        return bool(self.held)

    def begin_serving(self) -> None:
        self.serving = True

    def dummy_prompt(self, length: int) -> list[int]:
        return [5] * length

    def read_adapter(self, name: str, source: str) -> str:
        return f"/adapters/{name}"

    def pack(self, outputs: list[object]) -> list[bytes]:
        return [repr(outputs).encode()]

    def check(self) -> None:
        if self.surface_gone:
            raise RuntimeError("vLLM's surface process for front 0 (pid 1) exited with -9")

    def prepare(self, add: Add) -> Add:
        self.prepared.append(add.request_id)
        return replace(add, prepared=f"prepared {add.request_id}")

    def run(self, adds: list[Add], aborts: list[str], controls: list[Control]) -> StepResult:
        self.controls += controls
        result = StepResult(controls=[(c, None) for c in controls])
        self.runs_while_serving.append(self.serving)
        result.preempted = self.preempt
        for request_id in aborts:
            self.aborted.append(request_id)
            self.held.pop(request_id, None)
        for add in adds:
            if add.request_id in self.refuse:
                result.refused.append((add.request_id, self.refuse[add.request_id]))
                continue
            self.added.append(add)
            self.held[add.request_id] = 0
        # vLLM's priority scheduler: the lowest value first, then arrival; `capacity` run at once
        order = sorted(self.held, key=lambda r: next(a.priority for a in self.added if a.request_id == r))
        running = order[: self.capacity]
        # vLLM's new_logprobs: for each request that asked, rows as wide as the widest ask of the step
        # (the sampled token, then the most likely), here made up: ids 100.., values -1, -2, ...
        asks = {a.request_id: a.params.logprobs for a in self.added if a.params.logprobs is not None}
        width = 1 + max((asks[r] for r in running if r in asks), default=0)
        for request_id in running:
            if request_id not in self.scheduled:  # vLLM's first SCHEDULED event: waited since arrival
                self.scheduled.add(request_id)
                result.queue_waits.append(0.25)
                result.tokens += len(next(a for a in self.added if a.request_id == request_id).prompt)
            else:
                result.tokens += 1  # a decoding sequence's last token
            given = self.held[request_id]
            token = self.script[given]
            self.held[request_id] = given + 1
            finish = "stop" if token == EOS else None
            if (
                finish is None
                and given + 1 >= next(a for a in self.added if a.request_id == request_id).params.max_tokens
            ):
                finish = "length"
            logprobs = None
            if request_id in asks:
                ids = np.array([[token] + [100 + k for k in range(width - 1)]])
                logprobs = TokenLogprobs.of(ids, -np.arange(1.0, width + 1)[None, :])
            own = next(a for a in self.added if a.request_id == request_id).request is not None
            raw = (request_id, token) if own else None  # vLLM's EngineCoreOutput, made up
            result.deltas.append(Delta(request_id, [token], finish, logprobs, raw))
            if finish:
                del self.held[request_id]
        result.stats = Stats(len(running), len(order) - len(running), 0.25)
        if self.step_cost is not None:
            self.clock[0] += self.step_cost[0] + self.step_cost[1] * result.tokens
        return result


def make(backend: ScriptedVllm, **sections: dict[str, object]) -> VllmCore:
    config = runtime_config(model={"source": "fake", "task": "generate", "name": "smol"}, **sections)
    return VllmCore(backend, config, RuntimeMetrics("smol"))


def request(rid: int, max_tokens: int = 16, priority: int = 0, deadline: float = 1e9) -> GenerateRequest:
    return GenerateRequest(rid, 0, [1, 5, 6], SamplingParams(max_tokens=max_tokens), priority, 0.0, deadline)


def turn(core: VllmCore, now: float = 0.0) -> list[Output]:
    """One turn of the busy loop: schedule, run the launched step inline, complete it."""
    outputs, launch, _ = core.schedule(now)
    if launch is not None:
        outputs += launch.complete(launch.run(), None)
    return outputs


def texts(outputs: list[Output]) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for _, message in outputs:
        if isinstance(message, TokenOutput):
            ids.setdefault(message.rid, []).extend(message.ids)
    return ids


def test_tokens_stream_back_and_the_end_of_text_id_is_not_part_of_the_answer() -> None:
    backend = ScriptedVllm()
    core = make(backend)
    assert core.submit(request(1), 0.0) == []
    outputs: list[Output] = []
    while core.busy:
        outputs += turn(core)
    assert texts(outputs) == {1: [11, 12, 13]}
    last = outputs[-1][1]
    assert isinstance(last, TokenOutput) and last.finish == "stop"
    assert backend.added[0].prompt == [1, 5, 6] and backend.added[0].request_id == "1"


def test_logprobs_reach_vllm_and_come_back_cut_to_each_requests_own_width_end_of_text_without() -> None:
    backend = ScriptedVllm()
    core = make(backend)
    for rid, asked in ((1, None), (2, 1), (3, 3)):
        params = SamplingParams(max_tokens=16, logprobs=asked)
        assert core.submit(GenerateRequest(rid, 0, [1, 5, 6], params, 0, 0.0, 1e9), 0.0) == []
    outputs: list[Output] = []
    while core.busy:
        outputs += turn(core)
    assert [a.params.logprobs for a in backend.added] == [None, 1, 3]
    rows: dict[int, list[list[int]]] = {}
    for _, message in outputs:
        assert isinstance(message, TokenOutput)
        if message.rid == 1 or not message.ids:  # not asked; the end-of-text message: no ids, no rows
            assert message.logprobs is None
            continue
        assert message.logprobs is not None
        ids, values = message.logprobs.arrays()
        assert ids.shape == values.shape == (len(message.ids), {2: 2, 3: 4}[message.rid])
        rows.setdefault(message.rid, []).extend(ids.tolist())
    assert rows == {
        2: [[11, 100], [12, 100], [13, 100]],
        3: [[11, 100, 101, 102], [12, 100, 101, 102], [13, 100, 101, 102]],
    }


def test_the_queue_bound_answers_429_with_a_retry_after_from_vllms_waiting_count() -> None:
    backend = ScriptedVllm(capacity=1)
    core = make(backend, batching={"max_queue_size": 2})
    for rid in (1, 2):
        assert core.submit(request(rid), 0.0) == []
    turn(core)  # vLLM runs one, one waits
    assert core.submit(request(3), 0.0) == []  # joins at the next step: two waiting
    refused = core.submit(request(4), 0.0)
    assert len(refused) == 1
    message = refused[0][1]
    assert isinstance(message, ErrorOutput) and message.kind == "QueueFull"
    assert message.retry_after is not None and message.retry_after >= 1.0
    assert "4" not in {a.request_id for a in backend.added}


def test_a_request_vllm_refuses_is_answered_400_with_its_reason_and_the_others_run_on() -> None:
    backend = ScriptedVllm(refuse={"2": "The decoder prompt (length 3001) is longer than the maximum"})
    core = make(backend)
    core.submit(request(1), 0.0)
    core.submit(request(2), 0.0)
    outputs: list[Output] = []
    for _ in range(len(backend.script)):
        outputs += turn(core)
    assert not core.busy
    errors = [m for _, m in outputs if isinstance(m, ErrorOutput)]
    assert [(e.rid, e.kind) for e in errors] == [(2, "InvalidInput")]
    assert "vLLM refused the request: The decoder prompt (length 3001)" in errors[0].message
    assert texts(outputs) == {1: [11, 12, 13]}


def test_a_request_past_its_deadline_is_answered_504_and_aborted_in_vllm() -> None:
    backend = ScriptedVllm(script=[11] * 100)
    core = make(backend)
    core.submit(request(1, max_tokens=50, deadline=5.0), 0.0)
    turn(core, now=1.0)
    outputs = turn(core, now=6.0)  # the deadline has passed: answered, and withdrawn at this step
    errors = [m for _, m in outputs if isinstance(m, ErrorOutput)]
    assert len(errors) == 1 and errors[0].kind == "DeadlineExceeded"
    assert "after generating 1 tokens" in errors[0].message
    assert backend.aborted == ["1"] and not backend.held


def test_a_withdrawn_request_never_reaches_vllm_if_it_had_not_yet_and_is_aborted_if_it_had() -> None:
    backend = ScriptedVllm(script=[11] * 100)
    core = make(backend)
    core.submit(request(1, max_tokens=50), 0.0)
    turn(core)
    core.submit(request(2, max_tokens=50), 0.0)
    core.abort(Abort([1, 2]).rids)
    turn(core)
    assert backend.aborted == ["1"]
    assert [a.request_id for a in backend.added] == ["1"]
    assert not core.busy


def test_priorities_reach_vllm_in_its_order_highest_carpool_level_first() -> None:
    backend = ScriptedVllm(capacity=1)
    core = make(backend, batching={"priority_levels": 3})
    core.submit(request(1, max_tokens=2, priority=0), 0.0)
    core.submit(request(2, max_tokens=2, priority=2), 0.0)
    outputs = turn(core)
    assert [a.priority for a in backend.added] == [2, 0]
    assert texts(outputs) == {2: [11]}  # vLLM ran the high-priority one first
    assert vllm_priority(2, 3) == 0 and vllm_priority(0, 3) == 2


def test_an_adapter_is_named_or_refused_404_and_a_runtime_load_reaches_vllm() -> None:
    backend = ScriptedVllm()
    core = make(backend, lora={"adapters": {"shout": "/somewhere"}, "enabled": True})
    unknown = GenerateRequest(9, 0, [1], SamplingParams(), 0, 0.0, 1e9, adapter="whisper")
    refused = core.submit(unknown, 0.0)
    assert isinstance(refused[0][1], ErrorOutput) and refused[0][1].kind == "ModelNotFound"
    core.submit(GenerateRequest(1, 0, [1], SamplingParams(), 0, 0.0, 1e9, adapter="shout"), 0.0)
    assert core.submit(LoadAdapter(5, 0, "whisper", "/there"), 0.0) == []
    outputs = turn(core)
    added = backend.added[0].adapter
    assert added is not None and (added.name, added.path) == ("shout", "/adapters/shout")
    assert [c.adapter.name for c in backend.controls] == ["whisper"]
    assert any(
        isinstance(m, AdapterDone) and m.name == "whisper" and m.action == "loaded" for _, m in outputs
    )


def test_the_gauges_carry_vllms_scheduler_stats() -> None:
    backend = ScriptedVllm(capacity=1, script=[11] * 100)
    metrics = RuntimeMetrics("smol")
    config = runtime_config(model={"source": "fake", "task": "generate", "name": "smol"})
    core = VllmCore(backend, config, metrics)
    for rid in (1, 2, 3):
        core.submit(request(rid, max_tokens=50), 0.0)
    turn(core)
    core.publish_gauges()
    assert metrics.queue_depth._value.get() == 2
    assert metrics.running.labels("smol")._value.get() == 1
    assert metrics.kv_usage.labels("smol")._value.get() == 0.25


def test_vllms_preemptions_and_first_schedulings_feed_carpools_own_series() -> None:
    """`carpool_preemptions_total` and `carpool_queue_wait_seconds` under vLLM: from what vLLM's events
    say of each step (`vllm.stats` reads them)."""
    backend = ScriptedVllm(capacity=1, script=[11] * 3, preempt=1)
    metrics = RuntimeMetrics("smol")
    config = runtime_config(model={"source": "fake", "task": "generate", "name": "smol"})
    core = VllmCore(backend, config, metrics)
    for rid in (1, 2):
        core.submit(request(rid, max_tokens=3), 0.0)
    steps = 0
    while core.busy:
        turn(core)
        steps += 1
    assert metrics.preemptions._value.get() == steps
    waits = {s.name: s.value for s in metrics.queue_wait._samples()}
    assert waits["_count"] == 2 and waits["_sum"] == 0.5


def saturation_at(rate: float, objective: dict[str, object] | None) -> float | None:
    """`carpool_slo_saturation` after 40 s (simulated) of requests at `rate` a second (3 prompt tokens, 16
    new ones each) on a scripted vLLM whose steps cost 10 ms plus 1 ms a computed token; None where the
    gauge was never set."""
    backend = ScriptedVllm(script=[11] * 16, step_cost=(0.010, 0.001))
    metrics = RuntimeMetrics("smol")
    sections: dict[str, Any] = {} if objective is None else {"objective": objective}
    config = runtime_config(model={"source": "fake", "task": "generate", "name": "smol"}, **sections)
    core = VllmCore(backend, config, metrics, clock=lambda: backend.clock[0])
    core.warm_up()
    backend.clock[0] = 0.0
    rid, next_arrival = 0, 0.0
    while backend.clock[0] < 40.0:
        while next_arrival <= backend.clock[0]:
            rid += 1
            assert core.submit(request(rid, max_tokens=16), next_arrival) == []
            next_arrival += 1.0 / rate
        if core.busy:
            turn(core, backend.clock[0])
        else:
            backend.clock[0] = next_arrival
        core.publish_gauges()
    return metrics.registry.get_sample_value("carpool_slo_saturation", {"model": "smol"})


def test_a_latency_objective_on_vllms_engine_reads_its_load_over_the_load_that_meets_the_objective() -> None:
    """`carpool_slo_saturation` on vLLM's engine: the objective's service model is fitted to vLLM's steps
    (the tokens each computed, from vLLM's schedule, and its time), with the arrivals, their prompts and
    the finished sequences' lengths (`batching.saturation`). Here a step costs 10 ms + 1 ms a token, a
    request 3 prompt tokens and 16 steps, 16 sequences run at once: the batcher carries at most 34.5
    requests a second, p90 time to first token <= 1 s holds up to 90% of that (31 a second), so 5 a
    second reads 0.16 and three times the load three times as much. Without an objective, no gauge."""
    objective: dict[str, object] = {"latency_s": 1.0, "percentile": 90, "lead_s": 0.0}
    light, heavy = saturation_at(5.0, objective), saturation_at(15.0, objective)
    assert light is not None and heavy is not None
    assert light == pytest.approx(5.0 / 31.0, rel=0.2)
    assert heavy / light == pytest.approx(3.0, rel=0.15)
    assert saturation_at(5.0, None) is None


def test_vllms_own_metrics_start_after_the_warm_up() -> None:
    backend = ScriptedVllm(script=[11, EOS])
    config = runtime_config(
        model={"source": "fake", "task": "generate", "name": "smol"},
        warmup={"batch_sizes": [1], "sequence_lengths": [8], "iterations": 1},
    )
    core = VllmCore(backend, config, RuntimeMetrics("smol"))
    core.warm_up()
    assert backend.runs_while_serving and not any(backend.runs_while_serving) and backend.serving
    disabled = ScriptedVllm()
    model = {"source": "fake", "task": "generate", "name": "smol"}
    VllmCore(
        disabled, runtime_config(model=model, warmup={"enabled": False}), RuntimeMetrics("smol")
    ).warm_up()
    assert disabled.serving


SMALL = ModelFacts(context=512, layers=1, kv_heads=1, head_dim=1)


def test_engine_arguments_follow_the_config_and_vllm_args_win() -> None:
    config = runtime_config(
        model={
            "source": "x",
            "task": "generate",
            "name": "m",
            "tensor_parallel_size": 2,
            "vllm_args": {"enforce_eager": True, "max_num_seqs": "64"},
        },
        generation={"max_running_sequences": 8, "kv_cache_tokens": 1000},
        lora={"enabled": True, "max_loras": 2, "max_rank": 8},
    )
    facts = ModelFacts(context=4096, layers=2, kv_heads=8, head_dim=64)
    args = engine_args(config, "/m", "cuda", False, facts)
    # Per GPU: 2 layers x 4 of the 8 KV heads (tensor parallel 2) x 64 x K and V x 2 bytes, 1000 tokens.
    assert "max_model_len" not in args and args["kv_cache_memory_bytes"] == 1000 * 2 * 4 * 64 * 2 * 2
    assert args["scheduling_policy"] == "priority" and args["tensor_parallel_size"] == 2
    assert args["max_num_seqs"] == 64 and args["enforce_eager"] is True
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 2, 8)
    assert args["served_model_name"] == ["m"] and args["dtype"] == "auto"
    cpu = engine_args(runtime_config(model={"source": "x", "task": "generate"}), "/m", "cpu", True, SMALL)
    assert (
        cpu["max_model_len"] == 512 and cpu["dtype"] == "bfloat16" and cpu["kv_cache_memory_bytes"] == 1024**3
    )
    assert resolve_dtype(DType.AUTO, "cpu", False) == "float32"
    assert resolve_dtype(DType.FLOAT16, "cpu", True) == "float16"


def test_a_multi_node_group_meets_at_the_leader_address_the_leaderworkerset_gives() -> None:
    def group(rank: int, **model: object) -> dict[str, object]:
        config = runtime_config(
            model={
                "source": "x",
                "task": "generate",
                "nodes": 2,
                "node_rank": rank,
                "pipeline_parallel_size": 2,
            }
            | model
        )
        return engine_args(config, "/m", "cpu", True, SMALL, {"LWS_LEADER_ADDRESS": "group-0.lws"})

    worker = group(1)
    assert (worker["nnodes"], worker["node_rank"], worker["master_port"]) == (2, 1, 29500)
    assert worker["master_addr"] == "group-0.lws" and worker["pipeline_parallel_size"] == 2
    assert group(0, leader_address="10.0.0.7", leader_port=29555)["master_addr"] == "10.0.0.7"
    lone = runtime_config(
        model={"source": "x", "task": "generate", "nodes": 2, "node_rank": 1, "pipeline_parallel_size": 2}
    )
    with pytest.raises(ConfigError, match=r"set model\.leader_address"):
        engine_args(lone, "/m", "cpu", True, SMALL, {})
    assert "nnodes" not in engine_args(
        runtime_config(model={"source": "x", "task": "generate"}), "/m", "cpu", True, SMALL
    )


def test_auto_picks_vllm_for_generation_where_it_serves_the_model_and_says_why() -> None:
    generate = runtime_config(model={"source": "x", "task": "generate"})
    served = Probe("0.32.0", "LlamaForCausalLM", True, "cpu")
    choice = choose(generate, "/v/bin/python", served)
    assert choice.engine is EngineKind.VLLM and choice.python == "/v/bin/python"
    assert "vLLM 0.32.0 serves LlamaForCausalLM on cpu" in choice.reason
    unknown = Probe("0.32.0", "TinyForCausalLM", False, "cpu", "not in vLLM's model registry")
    fallback = choose(generate, "/v/bin/python", unknown)
    assert fallback.engine is EngineKind.CARPOOL and "does not serve TinyForCausalLM" in fallback.reason
    nothing = choose(generate, None, None)
    assert nothing.engine is EngineKind.CARPOOL and "make vllm" in nothing.reason
    embed = choose(runtime_config(model={"task": "embed"}), "/v/bin/python", served)
    assert embed.engine is EngineKind.CARPOOL


def test_engine_vllm_or_parallelism_without_vllm_is_refused_at_start() -> None:
    for model in ({"engine": "vllm"}, {"tensor_parallel_size": 2}):
        config = runtime_config(model={"source": "x", "task": "generate", **model})
        with pytest.raises(ConfigError, match="needs vLLM: no vLLM environment found"):
            choose(config, None, None)


def test_vllms_environment_is_found_beside_carpools(tmp_path: Path) -> None:
    python = tmp_path / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    python.chmod(0o755)
    assert find_python(None, "/usr/bin/python3", str(tmp_path / ".venv")) == str(python)
    assert find_python(None, "/usr/bin/python3", str(tmp_path / "elsewhere" / ".venv")) is None
    with pytest.raises(ConfigError, match="not an executable interpreter"):
        find_python(str(tmp_path / "nothing"))


def vllm_request(rid: int, slot: int = 1, priority: int = 0, deadline: float = 1e9) -> VllmRequest:
    return VllmRequest(rid, slot, [b"engine-core-request"], priority, 0.0, deadline, None)


def test_vllms_own_requests_reach_vllm_whole_and_their_outputs_go_back_whole_to_their_surface() -> None:
    backend = ScriptedVllm()
    core = make(backend, batching={"priority_levels": 3})
    core.submit(vllm_request(7, slot=1, priority=2), 0.0)  # from front 0's surface (slot 1 of 1 front)
    core.submit(request(8), 0.0)  # a front's own request (KServe v2) beside it
    outputs: list[Output] = []
    for _ in range(len(backend.script)):
        outputs += turn(core)
    assert not core.busy
    added = {a.request_id: a for a in backend.added}
    assert added["7"].request == [b"engine-core-request"] and added["7"].priority == 0  # carpool's highest
    packed = [(front, m) for front, m in outputs if isinstance(m, VllmOutputs)]
    assert [front for front, _ in packed] == [1] * len(backend.script)
    # vLLM's own outputs, end-of-text included (vLLM's output processor decides what to show)
    assert [m.data for _, m in packed] == [[repr([("7", t)]).encode()] for t in backend.script]
    assert texts(outputs) == {8: [11, 12, 13]}
    assert core.metrics.generated_tokens._value.get() == 2 * len(backend.script)


def test_a_request_from_vllms_surface_is_prepared_as_it_arrives_while_a_step_runs() -> None:
    """vLLM's engine preprocesses a request in its input thread as it comes in, while a step runs (a
    structured-output request's grammar starts compiling then); the core does the same at arrival, so the
    next step's schedule finds the grammar ready. Prepared only when the next step added it, the request
    waited one step more (TTFT p50 1.21-1.37x vLLM's server at 16 clients with a JSON schema on every
    request, the same at 1 client)."""
    backend = ScriptedVllm(script=[11] * 10)
    core = make(backend)
    core.submit(request(1, max_tokens=8), 0.0)
    _, launch, _ = core.schedule(0.0)  # a step begins (the model thread's)
    assert launch is not None
    assert core.submit(vllm_request(2), 0.0) == []  # arrives while it runs
    assert backend.prepared == ["2"], "not prepared as it arrived"
    launch.complete(launch.run(), None)
    turn(core)  # the next step adds it
    (added,) = [a for a in backend.added if a.request_id == "2"]
    assert added.prepared == "prepared 2" and backend.prepared == ["2"]


def test_vllms_own_requests_keep_carpools_rules_queue_bound_deadline_withdrawal() -> None:
    backend = ScriptedVllm(script=[11] * 100, capacity=1)
    core = make(backend, batching={"max_queue_size": 1})
    assert core.submit(vllm_request(1, deadline=5.0), 0.0) == []
    turn(core, now=1.0)
    assert core.submit(vllm_request(2), 1.0) == []
    refused = core.submit(vllm_request(3), 1.0)
    assert [(f, m.kind) for f, m in refused if isinstance(m, ErrorOutput)] == [(1, "QueueFull")]
    outputs = turn(core, now=6.0)
    expired = [(f, m.rid, m.kind) for f, m in outputs if isinstance(m, ErrorOutput)]
    assert expired == [(1, 1, "DeadlineExceeded")] and backend.aborted == ["1"]
    core.abort([2])
    turn(core, now=7.0)
    assert backend.aborted == ["1", "2"] and not core.busy


def test_a_surface_process_gone_stops_the_engine_loop() -> None:
    backend = ScriptedVllm()
    core = make(backend)
    backend.surface_gone = True
    with pytest.raises(RuntimeError, match="vLLM's surface process for front 0"):
        core.schedule(0.0)
