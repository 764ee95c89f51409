"""Causal language models with a paged KV cache, driven one step at a time by the iteration scheduler.

transformers runs the model's own forward pass; carpool supplies the cache (`paged.PagedKVCache`): a
sequence's cache lives in the blocks the scheduler's `BlockAllocator` gave it, so sequences join and
leave the running batch without touching each other's cache. Each step is one forward pass: every
decoding sequence's next token and every prompt chunk, laid end to end (see `paged`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Collection, Iterator
from collections.abc import Sequence as Seq
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from carpool.runtime.batching.continuous import StepPlan, Work
from carpool.runtime.config import (
    DEFAULT_CONTEXT_CAP,
    KV_TOKENS_PER_SEQUENCE,
    ConfigError,
    Decoder,
    GenerationConfig,
    LoraConfig,
    ModelConfig,
    Task,
)
from carpool.runtime.errors import InvalidInput, OutOfMemory
from carpool.runtime.models import quant, segments
from carpool.runtime.models.base import EngineInfo, TextSpec
from carpool.runtime.models.device import inference, is_out_of_memory, release_memory
from carpool.runtime.models.lean import LeanDecoder, supports
from carpool.runtime.models.lora import LoraModel, order
from carpool.runtime.models.paged import PagedKVCache, RowSlots, Segment, Segments, install, sliding_window
from carpool.runtime.models.text import sampling_defaults, text_spec
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.sources import ResolvedSource, SourceKind
from carpool.runtime.wire import TokenLogprobs

log = logging.getLogger(__name__)


def _load_tokenizer(source: ResolvedSource, config: ModelConfig) -> PreTrainedTokenizerBase:
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        source.location,
        gguf_file=source.gguf_file,
        revision=config.revision,
        trust_remote_code=config.trust_remote_code,
        local_files_only=source.kind is not SourceKind.HUB,
    )
    return tokenizer


def cache_gguf_name_maps() -> None:
    """transformers' GGUF loader builds gguf's `TensorNameMap` for the architecture once per module of the
    model (794 times for SmolLM2-135M, about 20 ms each), though it is a pure function of (architecture,
    blocks): cached, SmolLM2's load went from 14.6 to 9.4 s on this project's 2-core machine. Idempotent."""
    import gguf

    if not hasattr(gguf.get_tensor_name_map, "cache_info"):
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """transformers parses a GGUF file's header anew for the config, the tokenizer and the weights (a
    `gguf.GGUFReader` each, in `load_gguf_checkpoint`), and the parse walks every field element by element:
    SmolLM2-135M's 49,152-token vocabulary and its merges made each about 7 s of a 34 s load on this
    project's 2-core machine. While a model loads, one reader per file serves all three, and carpool's
    own read of the 4-bit codes (`quant`) after them (read only: the weights are dequantized into new
    arrays, the codes copied)."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]


class GenerationEngine:
    """A causal LM, its tokenizer and its paged KV cache."""

    def __init__(
        self,
        source: ResolvedSource,
        config: ModelConfig,
        generation: GenerationConfig,
        name: str,
        device: torch.device,
        dtype: torch.dtype,
        lora: LoraConfig | None = None,
    ) -> None:
        with one_gguf_parse() if source.gguf_file else contextlib.nullcontext():
            self.tokenizer = _load_tokenizer(source, config)
            if source.gguf_file:
                cache_gguf_name_maps()
            self.model = (
                AutoModelForCausalLM.from_pretrained(
                    source.location,
                    gguf_file=source.gguf_file,
                    revision=config.revision,
                    dtype=dtype,
                    trust_remote_code=config.trust_remote_code,
                    local_files_only=source.kind is not SourceKind.HUB,
                )
                .to(device)  # type: ignore[arg-type]
                .eval()
            )
            self.device = device
            self.quantization = self._quantize(source, config, device, dtype)  # reads the 4-bit codes
        self.lora: LoraModel | None = None
        """LoRA adapter slots, when `lora` is active: each sequence of a step may use its own adapter."""
        if lora is not None and lora.active:
            self.lora = LoraModel(self.model, lora.max_loras, lora.max_rank)
        self.paged_attention = install(self.model)
        if not self.paged_attention:
            log.warning(
                "%s cannot take a custom attention function: decoding gathers each step's keys and values",
                type(self.model).__name__,
            )
        model_config = self.model.config
        model_limit = int(getattr(model_config, "max_position_embeddings", DEFAULT_CONTEXT_CAP))
        self.max_model_len = min(generation.max_model_len or DEFAULT_CONTEXT_CAP, model_limit)
        if config.max_input_tokens:
            self.max_model_len = min(self.max_model_len, config.max_input_tokens)
        window = sliding_window(model_config)
        if window is not None and self.max_model_len > window:
            log.warning(
                "%s attends within a sliding window of %d tokens, which carpool's paged attention does not "
                "apply: contexts are capped at %d tokens (prompt and output), where the two are the same",
                type(self.model).__name__,
                window,
                window,
            )
            self.max_model_len = window
        self.block_size = generation.kv_block_size
        kv_tokens = generation.kv_cache_tokens or generation.running_sequences() * KV_TOKENS_PER_SEQUENCE
        self.num_blocks = -(-kv_tokens // self.block_size)
        usable = int(generation.kv_admit_watermark * self.num_blocks) * self.block_size
        if usable < self.max_model_len:
            raise ConfigError(
                f"generation.kv_cache_tokens ({kv_tokens}) x kv_admit_watermark "
                f"({generation.kv_admit_watermark}) holds {usable} tokens, less than one full context "
                f"({self.max_model_len} tokens): raise generation.kv_cache_tokens or lower "
                "generation.max_model_len"
            )
        heads = int(model_config.num_attention_heads)
        kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(model_config, "head_dim", None) or model_config.hidden_size // heads)
        self.cache = PagedKVCache(
            int(model_config.num_hidden_layers),
            self.num_blocks * self.block_size,
            kv_heads,
            head_dim,
            dtype,
            device,
        )
        self.attention = self._choose_attention(generation, heads)
        """Whether a step's sequences attend in one call per layer (`segments`), as measured here."""
        log.info("%s", self.attention.describe())
        self.lean: LeanDecoder | None = None
        """carpool's own step (`models.lean`), where `generation.decoder` and the model allow it."""
        why_not = "generation.decoder is transformers" if generation.decoder is Decoder.TRANSFORMERS else None
        why_not = why_not or supports(self.model)
        if why_not is None:
            self.lean = LeanDecoder(self.model, self.cache)
            log.info("steps run on carpool's own Llama-family decoder (generation.decoder auto)")
        else:
            log.info("steps run on transformers' forward: %s", why_not)
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        self._generators: dict[int, torch.Generator] = {}
        self.logprobs: dict[int, TokenLogprobs] = {}
        """The last step's log-probabilities, by sequence id, of the sequences whose params ask for them."""
        self._info = EngineInfo(
            name=name,
            task=Task.GENERATE,
            max_input_tokens=self.max_model_len,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            source=config.source,
            quantization=self.quantization,
        )

    def _quantize(
        self, source: ResolvedSource, config: ModelConfig, device: torch.device, dtype: torch.dtype
    ) -> str:
        """Store the linear layers as `model.quantization` asks (see `quant`); returns the scheme served."""
        gguf = os.path.join(source.location, source.gguf_file) if source.gguf_file else None
        mode, why = quant.resolve_mode(config.quantization.value, device, dtype, gguf is not None)
        if mode == "none":
            log.info("%s; linear layers in %s", why, str(dtype).removeprefix("torch."))
            return "none"
        report = quant.quantize_model(self.model, mode, gguf, dtype)
        layers = [m for m in self.model.modules() if isinstance(m, quant.QuantLinear)]
        choice = quant.choose_kernels(layers)
        picks = "; ".join(
            f"{kind} {out}x{inner}: dense bf16 at "
            + (",".join(str(b) for b, d in zip(quant.ROW_BUCKETS, dense, strict=True) if d) or "no")
            + " rows"
            for (out, inner, kind), dense in choice.items()
        )
        log.info("%s; %s; kernels measured per shape and row bucket: %s", why, report.describe(), picks)
        for kind, count in report.kept.items():
            if kind.startswith("GGUF"):
                log.warning("%d linear layers are %s, not Q4_0/Q4_1: served dequantized", count, kind)
        return report.scheme

    def _choose_attention(self, generation: GenerationConfig, heads: int) -> segments.Choice:
        """Time a decoding step's attention per sequence and batched on this device (`segments.choose`),
        over as many sequences as may run (at most 64) of up to 256 tokens of context."""
        scaling = float(self.cache.keys[0].shape[2] ** -0.5)  # the time does not depend on it
        with inference(self.device):
            return segments.choose(
                self.cache.keys[0],
                self.cache.values[0],
                heads,
                len(self.cache),
                min(generation.running_sequences(), 64),
                min(self.max_model_len, 256),
                scaling,
                quant.best_of,
            )

    @property
    def info(self) -> EngineInfo:
        return self._info

    # -- text ------------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise InvalidInput("this model has no chat template: use /v1/completions with a prompt")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # template errors (roles out of order, ...) are the caller's to fix
            raise InvalidInput(f"messages do not fit the model's chat template: {exc}") from exc
        if not isinstance(ids, list):
            ids = ids["input_ids"]  # type: ignore[index]
        return [int(i) for i in ids]  # type: ignore[arg-type]

    def decode(self, ids: Seq[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def text_spec(self) -> TextSpec:
        return text_spec(
            self.tokenizer,
            self.eos_ids,
            self.max_model_len,
            chat=True,
            cache_tokens=self.num_blocks * self.block_size,
            sampling_defaults=sampling_defaults(self.generation_config()),
            vocab_size=int(getattr(self.model.config, "vocab_size", 0) or 0),
        )

    def generation_config(self) -> dict[str, Any]:
        """What the model's `generation_config.json` sets (none: {})."""
        config = getattr(self.model, "generation_config", None)
        return dict(config.to_diff_dict()) if config is not None else {}

    def dummy_prompt(self, length: int) -> list[int]:
        filler = self.encode(" hello")[-1]
        return [filler] * length

    # -- steps -----------------------------------------------------------------------------------

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def release_memory(self) -> None:
        release_memory(self.device)

    def step(self, plan: StepPlan, params: dict[int, SamplingParams]) -> dict[int, int]:
        """Run one step; returns the token sampled for each sequence that reached the end of its input."""
        try:
            with inference(self.device):
                if self.paged_attention or self.lean is not None:
                    works = self._in_adapter_order(plan.work)
                    logits = self._forward_paged(works)
                    sampled_for = [w for w in works if w.sample]
                else:
                    logits, sampled_for = self._forward_gathered(plan)
                self.logprobs = {}
                if not sampled_for:
                    return {}
                rows = logits.float()
                sampled = self._sample(rows, sampled_for, params)
                if any(p.logprobs is not None for p in params.values()):
                    self.logprobs = token_logprobs(rows, sampled_for, params, sampled)
                return sampled
        except Exception as exc:
            if is_out_of_memory(exc):
                raise OutOfMemory(f"device out of memory: {exc}") from exc
            raise
        finally:
            if self.lora is not None:
                self.lora.clear_rows()

    def _in_adapter_order(self, works: list[Work]) -> list[Work]:
        """The step's sequences laid out so each adapter's decoding tokens lie side by side (`order`)."""
        if self.lora is None or not self.lora.slot_of:
            return works
        slot_of = self.lora.slot_of
        return [works[i] for i in order([(w.count, slot_of.get(w.seq.seq)) for w in works])]

    def _adapter_rows(self, works: Seq[Work], rows: Seq[tuple[int, int]]) -> None:
        """Tell the LoRA layers which rows (first, count) of the next forward pass each adapter runs on."""
        if self.lora is None:
            return
        slot_of = self.lora.slot_of
        runs = [
            (start, count, slot_of[work.seq.seq])
            for work, (start, count) in zip(works, rows, strict=True)
            if work.seq.seq in slot_of
        ]
        self.lora.set_rows(runs)

    def _slots(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        positions = torch.arange(start, stop)
        table = torch.tensor(blocks, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _row_slots(self, blocks: list[int], length: int) -> RowSlots:
        """The slots holding a sequence's first `length` tokens: a range when its blocks are contiguous."""
        used = -(-length // self.block_size)
        first = blocks[0]
        if all(block == first + i for i, block in enumerate(blocks[:used])):
            start = first * self.block_size
            return slice(start, start + length)
        return self._slots(blocks, 0, length).to(self.device)

    def _forward_paged(self, works: list[Work]) -> torch.Tensor:
        """The whole step in one forward pass: every sequence's new tokens end to end in one row.

        Returns the logits of the last token of each work that samples, in order.
        """
        tokens: list[int] = []
        positions: list[int] = []
        write: list[torch.Tensor] = []
        segments: list[Segment] = []
        keep: list[int] = []
        for work in works:
            stop = work.start + work.count
            tokens.extend(work.seq.all_tokens()[work.start : stop])
            positions.extend(range(work.start, stop))
            write.append(self._slots(work.seq.blocks, work.start, stop))
            mask = None
            if work.count > 1:  # each token sees the cached ones and those before it in this chunk
                past = torch.arange(work.start, stop)[:, None]
                mask = (torch.arange(stop)[None, :] <= past).to(self.device)
            offset = len(tokens) - work.count
            segments.append(Segment(slice(offset, len(tokens)), self._row_slots(work.seq.blocks, stop), mask))
            if work.sample:
                keep.append(len(tokens) - 1)
        self.cache.write_slots = torch.cat(write).to(self.device)
        self.cache.read_slots = None  # paged_attention reads the pools in place
        self._adapter_rows(works, [(s.queries.start, s.count) for s in segments])
        step = Segments(segments, self.attention.batched)
        if self.lean is not None:
            return self.lean.forward(
                torch.tensor(tokens, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                step,
                torch.tensor(keep, dtype=torch.long, device=self.device),
            )
        out = self.model(
            input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
            # an explicit 4-D mask is used as given; paged attention masks each segment itself
            attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
            paged_segments=step,
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    def _forward_gathered(self, plan: StepPlan) -> tuple[torch.Tensor, list[Work]]:
        """For models without paged attention: one forward for the decodes, one per prompt chunk."""
        rows: list[torch.Tensor] = []
        sampled_for: list[Work] = []
        if plan.decode:
            decode = self._in_adapter_order(plan.decode)
            rows.append(self._decode(decode))
            sampled_for.extend(decode)
        for work in plan.prefill:
            logits = self._prefill(work)
            if work.sample:
                rows.append(logits)
                sampled_for.append(work)
        return (torch.cat(rows) if rows else torch.empty(0)), sampled_for

    def _decode(self, work: list[Work]) -> torch.Tensor:
        tokens = torch.tensor([[w.seq.all_tokens()[w.start]] for w in work], dtype=torch.long)
        starts = torch.tensor([w.start for w in work], dtype=torch.long)
        length = max(w.start for w in work) + 1
        read = torch.zeros((len(work), length), dtype=torch.long)
        for row, w in enumerate(work):
            read[row, : w.start + 1] = self._slots(w.seq.blocks, 0, w.start + 1)
        self.cache.write_slots = read[torch.arange(len(work)), starts].to(self.device)
        self.cache.read_slots = read.to(self.device)
        mask = (torch.arange(length)[None, :] <= starts[:, None])[:, None, None, :]
        self._adapter_rows(work, [(row, 1) for row in range(len(work))])
        return self._forward(tokens, starts[:, None], mask)

    def _prefill(self, work: Work) -> torch.Tensor:
        stop = work.start + work.count
        tokens = torch.tensor([work.seq.all_tokens()[work.start : stop]], dtype=torch.long)
        slots = self._slots(work.seq.blocks, 0, stop)
        self.cache.write_slots = slots[work.start :].to(self.device)
        self.cache.read_slots = slots[None, :].to(self.device)
        positions = torch.arange(work.start, stop)
        mask = (torch.arange(stop)[None, :] <= positions[:, None])[None, None, :, :]
        self._adapter_rows([work], [(0, work.count)])
        return self._forward(tokens, positions[None, :], mask)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One forward pass through the gathered cache; the logits of each row's last token."""
        out = self.model(
            input_ids=tokens.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask.to(self.device),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def _sample(
        self, logits: torch.Tensor, works: list[Work], params: dict[int, SamplingParams]
    ) -> dict[int, int]:
        chosen = logits.argmax(dim=-1).tolist()
        result: dict[int, int] = {}
        for row, work in enumerate(works):
            sid = work.seq.seq
            p = params.get(sid, SamplingParams(temperature=0.0))
            row_logits = logits[row]
            if p.adjusts(len(work.seq.output)):
                row_logits = adjust_logits(row_logits, work.seq.tokens, work.seq.output, p, self.eos_ids)
                if p.greedy:
                    result[sid] = int(row_logits.argmax().item())
                    continue
            elif p.greedy:
                result[sid] = int(chosen[row])
                continue
            scores = row_logits / p.temperature
            if p.min_p > 0.0:  # vLLM's order: after temperature, before top-k and top-p
                scores = min_p_filter(scores, p.min_p)
            if p.top_k > 0:
                kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                cumulative = sorted_probs.cumsum(0)
                drop = cumulative - sorted_probs > p.top_p
                sorted_probs[drop] = 0.0
                probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
            generator = self._generators.get(sid)
            if generator is None:
                generator = torch.Generator(device=probs.device)
                if p.seed is not None:
                    generator.manual_seed(p.seed)
                else:
                    generator.seed()
                self._generators[sid] = generator
            result[sid] = int(torch.multinomial(probs, 1, generator=generator).item())
        return result


def adjust_logits(
    logits: torch.Tensor, prompt: Seq[int], output: Seq[int], params: SamplingParams, eos_ids: Collection[int]
) -> torch.Tensor:
    """One sequence's next-token logits (a 1-D row) with its request's logit bias, `min_tokens` and
    penalties applied, in the order vLLM's sampler applies them before greedy picks and before temperature,
    min-p, top-k and top-p (the logits processors that can change the argmax, logit bias and `min_tokens`,
    then the penalties): `logit_bias` added to its tokens; `min_tokens`: the sequence's stop tokens at
    -inf until it has that many; repetition: over prompt and output tokens; frequency and presence: over
    output tokens. A new float32 row; `logits` is left as it is."""
    scores = logits.float().clone()
    vocab = scores.numel()
    bias = {t: b for t, b in params.logit_bias.items() if 0 <= t < vocab}  # the fronts refuse the others
    if bias:
        ids = torch.tensor(list(bias), dtype=torch.long, device=scores.device)
        scores[ids] += torch.tensor(list(bias.values()), dtype=scores.dtype, device=scores.device)
    if len(output) < params.min_tokens:
        banned = [t for t in params.stop_ids(eos_ids) if 0 <= t < vocab]
        if banned:
            scores[banned] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
        tokens = [t for t in (*prompt, *output) if 0 <= t < vocab]
        if tokens:
            seen[torch.tensor(tokens, dtype=torch.long, device=scores.device)] = True
        factor = params.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / factor, scores * factor), scores)
    if output and (params.frequency_penalty or params.presence_penalty):
        ids = torch.tensor([t for t in output if 0 <= t < vocab], dtype=torch.long, device=scores.device)
        counts = torch.bincount(ids, minlength=vocab).to(scores.dtype)
        scores -= params.frequency_penalty * counts
        scores -= params.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def min_p_filter(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """A row of (temperature-scaled) logits with every token whose probability is below `min_p` times the
    most likely token's at -inf, as vLLM's `MinPLogitsProcessor` (the most likely token always stays)."""
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < min_p * probs.max(), float("-inf"))


def token_logprobs(
    logits: torch.Tensor, works: list[Work], params: dict[int, SamplingParams], sampled: dict[int, int]
) -> dict[int, TokenLogprobs]:
    """The sampled token's log-probability and the N most likely tokens' (N: the sequence's
    `params.logprobs`), for the rows of `logits` (float32, one per work) whose sequences ask, as vLLM's
    sampler computes them by default (`raw_logprobs`: log_softmax of the logits before temperature,
    top-k and top-p; `torch.topk` for the top N). Only those rows are computed."""
    asked = [
        (row, work.seq.seq, n)
        for row, work in enumerate(works)
        if (p := params.get(work.seq.seq)) is not None and (n := p.logprobs) is not None
    ]
    if not asked:
        return {}
    rows = torch.tensor([row for row, _, _ in asked], device=logits.device)
    logprobs = logits.index_select(0, rows).log_softmax(dim=-1, dtype=torch.float32)
    chosen = torch.tensor([[sampled[sid]] for _, sid, _ in asked], device=logits.device)
    top = logprobs.topk(max(n for _, _, n in asked), dim=-1)
    ids = torch.cat([chosen, top.indices], dim=1).cpu().numpy()
    values = torch.cat([logprobs.gather(1, chosen), top.values], dim=1).cpu().numpy()
    return {
        sid: TokenLogprobs.of(ids[k : k + 1, : n + 1], values[k : k + 1, : n + 1])
        for k, (_, sid, n) in enumerate(asked)
    }
