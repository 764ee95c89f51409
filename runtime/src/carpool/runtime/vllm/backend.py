"""vLLM's engine core in carpool's engine process: the real `core.VllmBackend`. Runs in vLLM's environment
only (`python -m carpool.runtime.vllm serve`); nothing outside `carpool.runtime.vllm` imports vllm.

The engine core (`vllm.v1.engine.core.EngineCore`: vLLM's scheduler, KV cache manager and executor) lives
in this process, as in vLLM's own `EngineCoreProc`; the model runs in vLLM's worker process (its
multiprocessing executor), as under `vllm serve`. Requests arrive as token ids (the fronts tokenize) and
leave as token ids (the fronts detokenize and watch for stop strings), so vLLM's input renderer and
output processor (its detokenizer) are not on the path; `InputProcessor` still turns each prompt and
sampling settings into vLLM's request, so vLLM applies the model's generation config and end-of-text ids
as its own server does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import yaml
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs.engine import tokens_input
from vllm.lora.request import LoRARequest
from vllm.renderers import renderer_from_config
from vllm.sampling_params import RequestOutputKind
from vllm.sampling_params import SamplingParams as VllmSampling
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, FinishReason
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.executor import Executor
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm.version import __version__ as VLLM_VERSION

from carpool.runtime.batching.saturation import BatchLimits
from carpool.runtime.config import ConfigError, RuntimeConfig
from carpool.runtime.errors import InvalidAdapter, InvalidInput
from carpool.runtime.models.text import sampling_defaults, text_spec
from carpool.runtime.sources import SourceKind, resolve_adapter_source, resolve_source
from carpool.runtime.vllm.args import engine_args, gguf_model, ignored_settings, read_facts
from carpool.runtime.vllm.convert import servable_folder
from carpool.runtime.vllm.core import Adapter, Add, Control, Delta, Stats, StepResult
from carpool.runtime.vllm.processes import SurfaceProcesses
from carpool.runtime.vllm.stats import VllmStats
from carpool.runtime.wire import EngineInfo, TextSpec, TokenLogprobs

log = logging.getLogger(__name__)

_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
    FinishReason.REPETITION: "stop",
}


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


USAGE_CONTEXT = UsageContext.OPENAI_API_SERVER
"""vLLM's own OpenAI server's: what carpool leaves unset (sequences, step tokens) vLLM resolves as `vllm
serve` would for the device (ENGINE_CONTEXT would give SchedulerConfig's 2048 step tokens on an H100)."""


def served_engine_args(config: RuntimeConfig) -> dict[str, Any]:
    """`EngineArgs` keywords for the served model on this machine: the leader's and every worker's (the
    ranks of a multi-node group must agree; dtype and KV cache follow the device). A GGUF is served as
    it is on CUDA, and converted to safetensors on CPU (vLLM's GGUF kernels are CUDA only), where
    `carpool fetch` may have done it already, into the model cache."""
    source = resolve_source(config.model.source)
    device = "cpu" if _is_cpu() else "cuda"
    native: dict[str, str] = {}
    if source.kind is SourceKind.HUB:
        folder = source.location
    elif source.gguf_file is not None and device != "cpu":
        folder = source.location
        native = gguf_model(folder, source.gguf_file)
    else:
        folder = servable_folder(source.location, source.gguf_file)
    args = engine_args(config, folder, device, cpu_has_bf16(), read_facts(folder), os.environ)
    kwargs = {**args, **native, **{k: v for k, v in args.items() if k in config.model.vllm_args}}
    for name in frontend_settings(config):
        kwargs.pop(name, None)  # the OpenAI server's, not the engine's: vLLM's surface takes them
    sections = {k: v for k, v in kwargs.items() if k in config.model.vllm_args and isinstance(v, dict)}
    return {**kwargs, **typed_as_vllm_serve(sections)}


def typed_as_vllm_serve(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Config sections of `model.vllm_args` (`structured_outputs_config: '{"enable_in_reasoning": true}'`,
    `compilation_config`, ...) as `vllm serve`'s parser types its flags: the config class `EngineArgs`
    needs (given a plain dict, some fail deep inside vLLM: "'dict' object has no attribute
    'reasoning_parser'"). A section vLLM's parser refuses is a ConfigError naming it."""
    if not sections:
        return {}
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))
    typed: dict[str, Any] = {}
    for name, value in sections.items():
        try:
            namespace = parser.parse_args(_flags({name: value}))
        except (argparse.ArgumentError, SystemExit, ValueError, TypeError) as exc:
            raise ConfigError(f"model.vllm_args.{name}: {exc}") from exc
        typed[name] = getattr(namespace, name)
    return typed


def _flags(values: dict[str, Any]) -> list[str]:
    """`vllm serve`'s command-line flags for `values` (a name with its parsed YAML value)."""
    flags: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, dict | list):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def _frontend_names() -> set[str]:
    """`vllm serve`'s own settings (its OpenAI server's: `tool_call_parser`, `enable_auto_tool_choice`,
    `chat_template`, ...), not `EngineArgs`'."""
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    engine = {field.name for field in dataclasses.fields(EngineArgs)}
    return {field.name for field in dataclasses.fields(FrontendArgs)} - engine


SURFACE_ENGINE_SETTINGS = ("reasoning_parser",)
"""`EngineArgs` names that vLLM's OpenAI server reads too (its reasoning parser)."""


def frontend_settings(config: RuntimeConfig) -> dict[str, Any]:
    """The entries of `model.vllm_args` that are `vllm serve`'s own (its OpenAI server's), parsed."""
    names = _frontend_names()
    return {name: yaml.safe_load(text) for name, text in config.model.vllm_args.items() if name in names}


def surface_cli(config: RuntimeConfig) -> list[str]:
    """`vllm serve`'s command-line flags for vLLM's surface: its own settings from `model.vllm_args`
    (`tool_call_parser: hermes`, `enable_auto_tool_choice: "true"`) and the engine's that it reads."""
    names = _frontend_names() | set(SURFACE_ENGINE_SETTINGS)
    return _flags(
        {name: yaml.safe_load(text) for name, text in config.model.vllm_args.items() if name in names}
    )


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A request as the engine core preprocessed it: one from vLLM's surface as it arrived
    (`VllmBackend.prepare`), or carpool's own as it is added."""

    request: Any
    """vLLM's `Request`."""
    wave: int
    prompt_len: int
    max_tokens: int | None


class VllmBackend:
    """vLLM's engine core over the served model."""

    def __init__(self, config: RuntimeConfig) -> None:
        model = config.model
        kwargs = served_engine_args(config)
        log.info("vLLM %s engine arguments: %s", VLLM_VERSION, kwargs)
        for setting in ignored_settings(config):
            log.warning("vLLM's engine ignores %s", setting)
        try:
            args = EngineArgs(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"model.vllm_args: {exc}") from exc
        vllm_config = args.create_engine_config(USAGE_CONTEXT)
        self._vllm_config = vllm_config
        renderer = renderer_from_config(vllm_config)
        self._tokenizer = renderer.tokenizer
        self._inputs = InputProcessor(vllm_config, renderer)
        self._core = EngineCore(vllm_config, Executor.get_class(vllm_config), log_stats=True)
        self._scheduled = 0
        """Tokens vLLM's scheduler gave the steps since `run` last looked (`_count_scheduled`)."""
        self._count_scheduled()
        self._tasks = self._core.get_supported_tasks()
        if "generate" not in self._tasks:
            raise ConfigError(f"vLLM serves {model.source!r} for {self._tasks}, not for generate")
        model_config = vllm_config.model_config
        self.max_model_len = int(model_config.max_model_len)
        eos = renderer.get_eos_token_id()
        # The generation config's end-of-text ids end a sequence too (vLLM's InputProcessor adds them to
        # every request's stop ids); `get_diff_sampling_param` carries none.
        generation_eos = (model_config.try_get_generation_config() or {}).get("eos_token_id")
        extra = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        self._eos_ids = {int(e) for e in [eos, *extra] if e is not None}
        cache = vllm_config.cache_config
        self._cache_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        self._info = EngineInfo(
            name=config.served_name(),
            task=model.task,
            max_input_tokens=self.max_model_len,
            device="cpu" if _is_cpu() else "cuda",
            dtype=str(model_config.dtype).removeprefix("torch."),
            source=model.source,
            engine=f"vllm {VLLM_VERSION}",
        )
        self._spec = text_spec(
            _hf_tokenizer(self._tokenizer),
            self._eos_ids,
            self.max_model_len,
            chat=True,
            cache_tokens=self._cache_tokens,
            sampling_defaults=sampling_defaults(model_config.get_diff_sampling_param()),
        )
        self._filler = self._tokenizer.encode("x", add_special_tokens=False)[0]
        self._requests = MsgpackDecoder(EngineCoreRequest)
        self._outputs = MsgpackEncoder()
        self._surfaced: set[str] = set()
        """Requests from vLLM's surface still in vLLM: their outputs go back whole (`Delta.raw`)."""
        self._timestamp = 0.0
        self.surfaces: SurfaceProcesses | None = None
        """vLLM's OpenAI surface, one process per front (`start_surfaces`)."""
        self._stats: VllmStats | None = None
        """vLLM's own metrics (`stats`), from `begin_serving` on: the warm-up is not counted."""

    @property
    def vllm_config(self) -> Any:
        return self._vllm_config

    @property
    def limits(self) -> BatchLimits:
        scheduler = self._vllm_config.scheduler_config
        return BatchLimits(int(scheduler.max_num_seqs), int(scheduler.max_num_batched_tokens))

    def _count_scheduled(self) -> None:
        """Count the tokens each of vLLM's schedules computes (`SchedulerOutput.total_num_scheduled_tokens`:
        prompt chunks less prefix-cache hits, one per decoding sequence): a step's size for the latency
        objective's service model. vLLM reports it nowhere else; the engine core calls its scheduler's
        `schedule` once a step (twice, for two batches in flight, with pipeline parallelism)."""
        scheduler = self._core.scheduler
        schedule = scheduler.schedule

        def counted(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            self._scheduled += int(getattr(output, "total_num_scheduled_tokens", 0) or 0)
            return output

        scheduler.schedule = counted

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return tuple(self._tasks)

    # -- facts ----------------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    def text_spec(self) -> TextSpec:
        return self._spec

    @property
    def eos_ids(self) -> set[int]:
        return self._eos_ids

    def dummy_prompt(self, length: int) -> list[int]:
        return [self._filler] * length

    def begin_serving(self) -> None:
        self._stats = VllmStats(self._vllm_config)

    def has_work(self) -> bool:
        """Requests in vLLM's scheduler, or batches still in flight: with pipeline parallelism vLLM keeps
        a queue of batches (one per stage) and a step may return before any of them is done."""
        return bool(self._core.scheduler.has_requests() or self._core.batch_queue)

    # -- the model thread -----------------------------------------------------------------------

    def run(self, adds: list[Add], aborts: list[str], controls: list[Control]) -> StepResult:
        result = StepResult()
        for control in controls:
            result.controls.append((control, self._apply(control)))
        if aborts:
            self._core.abort_requests(aborts)
            self._surfaced.difference_update(aborts)
            if self._stats is not None:
                self._stats.dropped(aborts)
        for add in adds:
            try:
                self._add(add)
            except (VLLMClientError, ValueError, TypeError) as exc:
                # vLLM's input validation (VLLMValidationError in 0.32, ValueError before): this
                # request ends at once, as a client error; the step runs for the others.
                log.info("vLLM refused request %s: %s", add.request_id, exc)
                result.refused.append((add.request_id, str(exc)))
        if self.has_work():
            self._scheduled = 0
            outputs, executed = self._core.step_fn()
            result.tokens = self._scheduled
            self._core.post_step(model_executed=executed)
            # None: this step only queued a batch (pipeline parallelism); its tokens come later.
            for batch in (outputs or {}).values():
                counts = self._stats.step(batch) if self._stats is not None else None
                if batch.scheduler_stats is not None:
                    stats = batch.scheduler_stats
                    result.stats = Stats(stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage)
                self._timestamp = batch.timestamp
                if counts is not None:
                    result.preempted += counts.preempted
                    result.queue_waits.extend(counts.queue_waits)
                for out in batch.outputs:
                    finish = _FINISH.get(out.finish_reason) if out.finish_reason is not None else None
                    if out.request_id in self._surfaced:
                        if finish is not None:
                            self._surfaced.discard(out.request_id)
                        result.deltas.append(Delta(out.request_id, out.new_token_ids, finish, raw=out))
                        continue
                    logprobs = None
                    if out.new_logprobs is not None:  # only for requests that asked
                        lists = out.new_logprobs
                        logprobs = TokenLogprobs.of(lists.logprob_token_ids, lists.logprobs)
                    result.deltas.append(Delta(out.request_id, list(out.new_token_ids), finish, logprobs))
        else:
            result.stats = Stats(0, 0, 0.0)
        return result

    def _add(self, add: Add) -> None:
        if add.request is not None:
            prepared = add.prepared if isinstance(add.prepared, _Prepared) else self._prepared(add)
            self._surfaced.add(add.request_id)
            self._submit(add, prepared)
            return
        params = add.params
        sampling = VllmSampling(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            logprobs=params.logprobs,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            min_tokens=params.min_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            logit_bias=dict(params.logit_bias) or None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        request = self._inputs.process_inputs(
            add.request_id,
            tokens_input(add.prompt),
            sampling,
            self._tasks,
            arrival_time=add.arrival,
            lora_request=_lora(add.adapter),
            priority=add.priority,
        )
        request.external_req_id = request.request_id
        core_request, wave = self._core.preprocess_add_request(request)
        self._submit(add, _Prepared(core_request, wave, len(add.prompt), params.max_tokens))

    def prepare(self, add: Add) -> Add:
        """A request from vLLM's surface, decoded and preprocessed as it arrives (in the loop thread, while
        the model thread may be stepping: as vLLM's `EngineCoreProc` does in its input thread). Its grammar,
        for structured output, compiles meanwhile: added at the start of the next step, after the
        preprocessing, it would still be compiling when that step's schedule looked, and wait a whole
        step more (at 16 streaming clients on 2 cores about 150 ms: TTFT p50 1.21-1.37x vLLM's server
        with a JSON schema on every request, while 1-client TTFT was the same). One that fails here is
        left to `run`, which refuses it with vLLM's reason."""
        try:
            prepared = self._prepared(add)
        except (VLLMClientError, ValueError, TypeError):
            return add
        return dataclasses.replace(add, prepared=prepared, prompt_tokens=prepared.prompt_len)

    def _prepared(self, add: Add) -> _Prepared:
        assert add.request is not None
        # vLLM's own request, rendered and checked by vLLM's serving classes in the surface; the engine's
        # id is carpool's rid, and carpool decides the priority and the adapter.
        request: EngineCoreRequest = self._requests.decode(add.request)
        request.request_id = add.request_id
        request.priority = add.priority
        request.arrival_time = add.arrival
        request.lora_request = _lora(add.adapter)
        sampling_params = request.sampling_params
        max_tokens = None if sampling_params is None else sampling_params.max_tokens
        prompt_len = len(request.prompt_token_ids or [])
        core_request, wave = self._core.preprocess_add_request(request)
        return _Prepared(core_request, wave, prompt_len, max_tokens)

    def _submit(self, add: Add, prepared: _Prepared) -> None:
        """Hands a preprocessed request to vLLM's engine core and counts it in vLLM's series. Its
        `arrival_time` is carpool's (monotonic) on both paths, so the scheduler's order among requests of
        one priority is arrival order; vLLM's wall-clock latencies come from the stats logger
        (`stats.added`)."""
        self._core.add_request(prepared.request, prepared.wave)
        if self._stats is not None:
            name = None if add.adapter is None else add.adapter.name
            self._stats.added(add.request_id, add.arrival, prepared.prompt_len, prepared.max_tokens, name)

    def pack(self, outputs: list[object]) -> list[bytes]:
        batch = EngineCoreOutputs(outputs=outputs, timestamp=self._timestamp)
        return [bytes(buffer) for buffer in self._outputs.encode(batch)]

    def check(self) -> None:
        if self.surfaces is not None:
            self.surfaces.check()

    def _apply(self, control: Control) -> InvalidInput | None:
        adapter = control.adapter
        try:
            if control.unload:
                self._core.remove_lora(adapter.id)
            else:
                self._core.add_lora(_lora(adapter))
        except Exception as exc:  # vLLM's reasons (rank too large, shapes that do not match the model)
            return InvalidInput(f"LoRA adapter {adapter.name!r}: {type(exc).__name__}: {exc}")
        return None

    def read_adapter(self, name: str, source: str) -> str:
        try:
            resolved = resolve_adapter_source(source)
        except ConfigError as exc:
            raise InvalidAdapter(str(exc)) from exc
        if resolved.kind is SourceKind.HUB:
            return resolved.location
        folder = Path(resolved.location)
        if not (folder / "adapter_config.json").is_file():
            raise InvalidAdapter(f"LoRA adapter {name!r}: no adapter_config.json in {folder}")
        return str(folder)

    def shutdown(self) -> None:
        if self.surfaces is not None:
            self.surfaces.stop()
        self._core.shutdown()


def _lora(adapter: Adapter | None) -> LoRARequest | None:
    return None if adapter is None else LoRARequest(adapter.name, adapter.id, adapter.path)


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer inside vLLM's wrapper (a pool of copies in vLLM 0.32)."""
    for attribute in ("tokenizer", "_tokenizer"):
        inner = getattr(tokenizer, attribute, None)
        if inner is not None and hasattr(inner, "backend_tokenizer"):
            return inner
    return tokenizer
