"""What the routers hold: one front's view of the served model, over the engine client.

A front validates, tokenizes, sends token ids to the engine and turns what comes back into answers:
rows of floats for encoders (`infer`), text deltas for generation (`generate`). It holds no queue: the
engine admits (429), orders, expires (504) and cancels. Its lifecycle follows the engine's (loading,
warming, ready, failed) plus its own drain: on SIGTERM it refuses new requests (503), answers the ones
it accepted, and then tells the engine it is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from collections.abc import Sequence as Seq
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from carpool.runtime import threads
from carpool.runtime.api.admission import ContextLimits, generation_budget
from carpool.runtime.api.client import EngineClient
from carpool.runtime.api.tally import TurnTally
from carpool.runtime.api.text import StopTracker, TextCodec, TokenTexts
from carpool.runtime.config import RuntimeConfig, Task
from carpool.runtime.errors import BatchFailed, Forbidden, InputTooLong, InvalidInput, ModelNotFound, NotReady
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.wire import (
    AdapterDone,
    AdapterInfo,
    EncodeRequest,
    EngineInfo,
    EngineState,
    GenerateRequest,
    LoadAdapter,
    OpenAIReply,
    OpenAIRequest,
    TokenLogprobs,
    UnloadAdapter,
)

log = logging.getLogger(__name__)

FIRST_STATUS_S = 2.0
"""How long a starting front waits for every engine process's first status (they send one at least
every half second) before it serves anyway (refusing as loading until one comes)."""

T = TypeVar("T")

READ_BEFORE_DRAIN = "carpool.read_before_drain"
"""ASGI scope key, set by the drain (`api.draining`) on each request it answers though it began: one the
server had already read when it began (its connection was busy with it, so the drain could not close it
unread), or one that arrives on a keep-alive connection the drain holds open for its client's next request."""
REQUEST: ContextVar[Mapping[str, Any] | None] = ContextVar("carpool_request", default=None)
"""The ASGI scope of the HTTP request being served (`api.frontdoor` sets it)."""

INLINE_CHARACTERS = 16_384
"""Texts up to this size in all are tokenized on the event loop (cheaper than a thread hop); longer ones
in a thread, so one huge request does not stall every other."""


@dataclass
class InferResult:
    outputs: np.ndarray[Any, Any]
    """One row per input, in order (embedding rows, class probabilities): float32 [inputs, width]."""
    prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, for the OpenAI answers' `logprobs`."""

    token: str
    """The token's own text (`api.text.TokenTexts`)."""
    logprob: float
    top: list[tuple[str, float]]
    """The sampled token, then the most likely ones, each id once (the order of vLLM's per-position
    dict: the sampled token first, also when it is among the most likely), as (text, logprob)."""


@dataclass
class Delta:
    """A piece of a generation: new text, the logprobs of the tokens it adds (where asked: their text
    may lag behind, held back for a stop string), and at the end the finish reason."""

    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


class Generation:
    """One queued generation (one of a request's `n` choices): the deltas to iterate, and its token
    counts as they grow."""

    def __init__(self, prompt_tokens: int, index: int = 0, release: Callable[[], None] | None = None) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.index = index
        """Which of the request's choices this is (0..n-1)."""
        self.deltas: AsyncGenerator[Delta, None]
        self._release = release

    def release(self) -> None:
        """This choice is done with (idempotent); the request stops counting as in flight once all of its
        choices are."""
        release, self._release = self._release, None
        if release is not None:
            release()

    async def close(self) -> None:
        """Stop following this choice (its sequence leaves the engine if it is still there) and release
        it, also where its deltas were never started (closing an unstarted generator runs nothing)."""
        await self.deltas.aclose()
        self.release()


class Frontend:
    """One HTTP front's model service: validation, tokenization, the engine's answers, drain."""

    def __init__(
        self,
        config: RuntimeConfig,
        client: EngineClient,
        metrics: RuntimeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = config.served_name()
        self.client = client
        self.metrics = metrics or RuntimeMetrics(self.name)
        self.clock = clock
        self.draining = False
        self.drain_started = asyncio.Event()
        """Set when the drain begins (the gRPC health service turns NOT_SERVING on it)."""
        self._text: TextCodec | None = None
        self._tokenizer_thread = threads.one_thread_pool("carpool-tokenize", threads.TOKENIZER)
        self._inflight = 0
        self._no_inflight = asyncio.Event()
        self._no_inflight.set()
        self.tally = TurnTally(self.metrics, lambda: self._inflight)
        """Request metrics, written once per loop turn (`api.tally`)."""

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the engine and learn its state before the server accepts anything. The listening
        sockets exist before the fronts start (`server.bind`) and the kernel queues connections on each,
        so a front that starts beside running engines (a second front, a restarted one) serves its queue
        at once: answered before the engine's first status reached it, those requests were refused as
        "loading" by a pod already ready (test_engine_processes met a 503 on its fifth request)."""
        await self.client.start()
        if not await self.client.heard(FIRST_STATUS_S):
            log.info("the engine has not spoken yet (still starting): requests are refused until it is ready")

    def begin_drain(self) -> None:
        """From now on, new requests are refused (503); idempotent."""
        if self.draining:
            return
        self.draining = True
        self.drain_started.set()
        log.info("draining: %d requests in flight", self._inflight)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, finish accepted ones (up to `timeout_s`); True if all finished. Then the
        engine is told that this front is done."""
        self.begin_drain()
        try:
            await asyncio.wait_for(self._no_inflight.wait(), timeout_s)
            finished = True
        except TimeoutError:
            log.warning("drain timed out after %.1fs with %d requests unanswered", timeout_s, self._inflight)
            finished = False
        return finished

    async def close(self) -> None:
        await self.client.close(goodbye=True)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def state(self) -> EngineState:
        engine = self.client.state
        if self.draining and engine is not EngineState.FAILED:
            return EngineState.STOPPED if engine is EngineState.STOPPED else EngineState.DRAINING
        return engine

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def live(self) -> bool:
        """The engine runs (or is still loading): false once it has died, failed or gone silent."""
        return self.client.dead is None

    @property
    def failure(self) -> str | None:
        status = self.client.status
        return self.client.dead or (status.failure if status is not None else None)

    @property
    def info(self) -> EngineInfo:
        self._require_ready()
        status = self.client.status
        assert status is not None and status.info is not None
        return status.info

    # -- LoRA adapters --------------------------------------------------------------------------

    @property
    def adapters(self) -> tuple[AdapterInfo, ...]:
        """The LoRA adapters the engine serves, as of its last status."""
        status = self.client.status
        return status.adapters if status is not None else ()

    def resolve(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names: None for the base model (or no name). Without LoRA
        any other name is 404 here; with it the engine decides (404 for a name it does not serve), since
        an adapter loaded through another front may not have reached this front's status yet."""
        if model is None or model == self.name:
            return None
        if self.config.lora.active:
            return model
        raise ModelNotFound(f"model {model!r} is not served here; this server serves {self.name!r}")

    def serves(self, model: str) -> bool:
        """`model` is the base model or one of its adapters (as of the engine's last status)."""
        return model == self.name or any(adapter.name == model for adapter in self.adapters)

    async def load_adapter(self, name: str, source: str) -> AdapterDone:
        self._require_runtime_updates()
        return await self.client.control(LoadAdapter(self.client.next_rid(), self.client.front, name, source))

    async def unload_adapter(self, name: str) -> AdapterDone:
        self._require_runtime_updates()
        return await self.client.control(UnloadAdapter(self.client.next_rid(), self.client.front, name))

    def _require_runtime_updates(self) -> None:
        lora = self.config.lora
        if not lora.active:
            raise InvalidInput(
                f"model {self.name!r} serves no LoRA adapters: start it with lora.enabled (or lora.adapters)"
            )
        if not lora.runtime_updates:
            raise Forbidden(
                "loading and unloading LoRA adapters at run time is off on this server: name them in "
                "lora.adapters, or start it with lora.runtime_updates: true"
            )
        self._require_ready()

    def _read_before_drain(self) -> bool:
        scope = REQUEST.get()
        if scope is None:
            return False
        return bool(scope.get(READ_BEFORE_DRAIN))

    def _require_ready(self) -> None:
        state = self.state
        if state is EngineState.READY:
            return
        if state is EngineState.DRAINING and (not self.draining or self._read_before_drain()):
            # The engine serves until this front says goodbye, which it says once its own drain has
            # answered what it accepted. Not draining yet: the engine's SIGTERM came before this front's
            # own (the supervisor passes it to each process); the front's drain will close the idle
            # keep-alive connections, and until then a request on one of those is answered (with
            # `Connection: close`). Draining: the server had read this request before the drain began,
            # though its handler runs only now (the event loop's next turn, or a body still arriving), or
            # it came on a keep-alive connection the drain holds open for its client's next request:
            # answered, and the connection closes after it.
            return
        if state in (EngineState.DRAINING, EngineState.STOPPED):
            raise NotReady("the server is shutting down; send the request to another replica", 1.0)
        if state is EngineState.FAILED:
            raise NotReady(f"the model engine is not running: {self.failure}", 30.0)
        raise NotReady(f"the model is {state.value}; retry shortly", 5.0)

    def _codec(self) -> TextCodec:
        if self._text is None:
            status = self.client.status
            assert status is not None and status.text is not None, "the engine sends its tokenizer when ready"
            self._text = TextCodec(status.text)
        return self._text

    # -- encoders -------------------------------------------------------------------------------

    async def infer(
        self, texts: Seq[str], priority: int | None = None, timeout_s: float | None = None
    ) -> InferResult:
        """Batch `texts` with everyone else's (in the engine) and return one row per text, in order."""
        info = self.info
        if info.task is Task.GENERATE:
            raise InvalidInput(
                f"model {self.name!r} generates text: use /v1/completions or /v1/chat/completions"
            )
        if info.task is Task.RERANK:
            raise InvalidInput(f"model {self.name!r} scores query-document pairs: use POST /v1/rerank")
        arrival = self.clock()
        self._check_texts(texts, "input")
        priority, deadline = self._admission(priority, timeout_s, arrival)
        self._enter()
        try:
            codec = self._codec()
            tokens = await self._tokenize(texts, lambda: codec.encode_batch(texts))
            self._check_lengths(tokens, info.max_input_tokens, "input")
            request = EncodeRequest(
                self.client.next_rid(), self.client.front, tokens, priority, arrival, deadline
            )
            return await self._encode(request)
        finally:
            self._leave()

    async def rerank(
        self, query: str, documents: Seq[str], priority: int | None = None, timeout_s: float | None = None
    ) -> InferResult:
        """Score each (query, document) pair with the served cross-encoder, batched with everyone else's
        inputs (a pair is one input, tokenized as a text pair): one score per document, in order."""
        info = self.info
        if info.task is not Task.RERANK:
            raise InvalidInput(
                f"model {self.name!r} does {info.task.value}, not rerank: /v1/rerank needs a cross-encoder "
                "(model.task rerank)"
            )
        arrival = self.clock()
        self._check_texts([query], "query")
        self._check_texts(documents, "documents")
        priority, deadline = self._admission(priority, timeout_s, arrival)
        self._enter()
        try:
            codec = self._codec()
            pairs = await self._tokenize([query, *documents], lambda: codec.encode_pairs(query, documents))
            tokens = [ids for ids, _ in pairs]
            self._check_lengths(tokens, info.max_input_tokens, "documents", " (with the query)")
            request = EncodeRequest(
                self.client.next_rid(),
                self.client.front,
                tokens,
                priority,
                arrival,
                deadline,
                pairs=[second for _, second in pairs],
            )
            return await self._encode(request)
        finally:
            self._leave()

    def _check_texts(self, texts: Seq[str], field: str) -> None:
        limit = self.config.batching.items_limit
        if not texts:
            raise InvalidInput(f"{field} is empty: send at least one text")
        if len(texts) > limit:
            raise InvalidInput(f"too many inputs: {len(texts)} in one request, the limit is {limit}")
        tokens = self.info.max_input_tokens
        for index, text in enumerate(texts):
            where = field if field == "query" else f"{field}[{index}]"
            if not text:
                raise InvalidInput(f"{where} is an empty string")
            # A text far longer than the limit is refused without tokenizing it (cheap guard against
            # megabyte strings); 64 characters per token is beyond any real tokenizer.
            if len(text) > 64 * tokens:
                raise InputTooLong(
                    f"{where} has {len(text)} characters, far more than the {tokens}-token limit"
                )

    async def _tokenize(self, texts: Seq[str], encode: Callable[[], T]) -> T:
        """`encode()` on the event loop for short texts, else in the tokenizer thread."""
        if sum(len(text) for text in texts) <= INLINE_CHARACTERS:
            return encode()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, encode)

    @staticmethod
    def _check_lengths(tokens: Seq[Seq[int]], limit: int, field: str, note: str = "") -> None:
        for index, ids in enumerate(tokens):
            if len(ids) > limit:
                raise InputTooLong(
                    f"{field}[{index}] has {len(ids)} tokens{note}; this model accepts at most {limit}"
                )

    async def _encode(self, request: EncodeRequest) -> InferResult:
        output = await self.client.encode(request)
        rows = np.frombuffer(output.data, dtype=output.dtype).reshape(output.shape)
        return InferResult(outputs=rows, prompt_tokens=sum(len(t) for t in request.tokens))

    # -- generation -----------------------------------------------------------------------------

    async def generate(
        self,
        params: SamplingParams,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        priority: int | None = None,
        timeout_s: float | None = None,
        max_tokens_given: bool = True,
        adapter: str | None = None,
    ) -> Generation:
        """Tokenize, check the limits, and queue one sequence (with the LoRA `adapter`, see `resolve`);
        iterate `deltas` for its text (the request counts as in flight until that iteration ends: start
        it, or `close` it)."""
        generations = await self.generate_many(
            params, 1, prompt, messages, priority, timeout_s, max_tokens_given, adapter
        )
        return generations[0]

    async def generate_many(
        self,
        params: SamplingParams,
        n: int,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        priority: int | None = None,
        timeout_s: float | None = None,
        max_tokens_given: bool = True,
        adapter: str | None = None,
    ) -> list[Generation]:
        """`generate` for `n` independent choices of one prompt (OpenAI's `n`): tokenized once, queued as
        `n` sequences with the same priority and deadline, which the engine batches like any others. With
        a seed, choice i samples with seed + i (vLLM's `ParentRequest`), so each is reproducible alone.
        The request counts as in flight until every choice's iteration has ended or been `close`d."""
        info = self.info
        if info.task is not Task.GENERATE:
            raise InvalidInput(f"model {self.name!r} does {info.task.value}, not text generation")
        arrival = self.clock()
        priority, deadline = self._admission(priority, timeout_s, arrival)
        self._enter()  # accepted from here: a drain waits for it
        try:
            return await self._queue(
                params, n, prompt, messages, priority, arrival, deadline, max_tokens_given, adapter
            )
        except BaseException:
            self._leave()
            raise

    async def _queue(
        self,
        params: SamplingParams,
        n: int,
        prompt: str | None,
        messages: list[dict[str, str]] | None,
        priority: int,
        arrival: float,
        deadline: float,
        max_tokens_given: bool,
        adapter: str | None = None,
    ) -> list[Generation]:
        if messages is None and not prompt:
            # Refused before tokenizing: a tokenizer that adds special tokens would make it look non-empty.
            raise InvalidInput("the prompt is empty")
        codec = self._codec()
        loop = asyncio.get_running_loop()
        if messages is not None:
            ids = await loop.run_in_executor(self._tokenizer_thread, codec.encode_chat, messages)
        else:
            ids = await loop.run_in_executor(self._tokenizer_thread, codec.encode, prompt or "")
        if not ids:
            raise InvalidInput("the prompt is empty")
        spec = codec.spec
        # An engine that does not announce its cache size (0) is bounded by the context alone.
        limits = ContextLimits(spec.max_model_len, spec.cache_tokens or spec.max_model_len)
        given = params.max_tokens if max_tokens_given else None
        max_tokens = generation_budget(len(ids), given, params.max_tokens, limits)
        if params.min_tokens > max_tokens:  # vLLM's check, once the budget is known
            raise InvalidInput(
                f"min_tokens ({params.min_tokens}) must be less than or equal to max_tokens ({max_tokens}"
                f"{'' if given is not None else ', the default for this prompt'})"
            )
        if params.logit_bias:  # vLLM's check, against the model's logits (its processor's)
            vocabulary = spec.vocab_size or self.vocabulary
            bad = sorted(token for token in params.logit_bias if not 0 <= token < vocabulary)
            if bad:
                raise InvalidInput(
                    f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocabulary}"
                )
        params = replace(params, max_tokens=max_tokens)
        left = n

        def release() -> None:
            nonlocal left
            left -= 1
            if left == 0:
                self._leave()

        generations = []
        for index in range(n):
            seeded = params if params.seed is None else replace(params, seed=params.seed + index)
            request = GenerateRequest(
                self.client.next_rid(), self.client.front, ids, seeded, priority, arrival, deadline, adapter
            )
            generation = Generation(len(ids), index, release)
            generation.deltas = self._follow(request, generation, codec)
            generations.append(generation)
        return generations

    async def _follow(
        self, request: GenerateRequest, generation: Generation, codec: TextCodec
    ) -> AsyncGenerator[Delta, None]:
        detokenizer = codec.detokenizer()
        stops = StopTracker(request.params.stop, request.params.min_tokens)
        texts = codec.token_texts() if request.params.logprobs is not None else None
        outputs = self.client.generate(request)
        try:
            async for output in outputs:
                ids = output.ids
                if stops.stop and len(ids) > 1:
                    # A stop string may end the text within this message: the tokens after the one that
                    # completed it are not part of the answer (nor counted, nor given logprobs: vLLM).
                    text, kept = "", 0
                    while kept < len(ids) and not stops.stopped:
                        text += stops.push(detokenizer.push(ids[kept : kept + 1]))
                        kept += 1
                else:
                    text, kept = stops.push(detokenizer.push(ids), len(ids)), len(ids)
                generation.completion_tokens += kept
                logprobs = None
                if texts is not None:
                    logprobs = _logprobs(texts, output.logprobs, kept)
                finish = "stop" if stops.stopped else output.finish
                if finish is not None:
                    yield Delta(text + stops.flush(), finish, logprobs)
                    return  # leaving the stream early (a stop string) aborts the sequence in the engine
                if text or logprobs:
                    yield Delta(text, None, logprobs)
        finally:
            await outputs.aclose()
            generation.release()

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The model's generation-config sampling defaults (where a request is silent)."""
        status = self.client.status
        return status.text.sampling_defaults if status is not None and status.text is not None else {}

    # -- tokens ---------------------------------------------------------------------------------

    def tokenize(
        self,
        prompt: str | None,
        messages: list[dict[str, str]] | None,
        add_special: bool,
        add_generation: bool,
    ) -> tuple[list[int], list[str], int]:
        """(ids, their token strings, the context) as vLLM's `/tokenize` answers, with this model's
        tokenizer and chat template."""
        self._require_ready()
        codec = self._codec()
        if messages is not None:
            ids = codec.encode_chat(messages, add_generation)
        else:
            ids = codec.encode_plain(prompt or "", add_special)
        return ids, codec.token_strings(ids), codec.spec.max_model_len or self.info.max_input_tokens

    @property
    def vocabulary(self) -> int:
        """How many token ids the model's tokenizer has (generation; the model must be ready)."""
        return int(self._codec().tokenizer.get_vocab_size(with_added_tokens=True))

    def detokenize(self, ids: list[int]) -> str:
        self._require_ready()
        codec = self._codec()
        vocabulary = self.vocabulary
        bad = [token for token in ids if token >= vocabulary]
        if bad:
            raise InvalidInput(f"tokens: {bad[0]} is not a token id of this model (it has {vocabulary})")
        return codec.decode(ids)

    # -- vLLM's surface -------------------------------------------------------------------------

    @property
    def on_vllm(self) -> bool:
        """The model runs on vLLM's engine: its OpenAI routes are vLLM's own server's (`api.surface`)."""
        status = self.client.status
        return status is not None and status.info is not None and status.info.engine.startswith("vllm")

    async def relay(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        priority: int | None,
        timeout_s: float | None,
    ) -> AsyncGenerator[OpenAIReply, None]:
        """Hand an OpenAI request to vLLM's server in this front's surface process, with carpool's priority
        and deadline; the pieces of its answer (the request counts as in flight until they end)."""
        self._require_ready()
        arrival = self.clock()
        priority, deadline = self._admission(priority, timeout_s, arrival)
        request = OpenAIRequest(
            self.client.next_rid(), method, path, headers, body, priority, arrival, deadline
        )
        self._enter()
        try:
            async for reply in self.client.relay(request):
                yield reply
        finally:
            self._leave()

    # -- accounting -----------------------------------------------------------------------------

    def _admission(self, priority: int | None, timeout_s: float | None, arrival: float) -> tuple[int, float]:
        batching = self.config.batching
        if priority is None:
            priority = batching.default_priority
        if not 0 <= priority < batching.priority_levels:
            raise InvalidInput(f"priority {priority} is outside 0..{batching.priority_levels - 1}")
        if timeout_s is not None and timeout_s <= 0:
            raise InvalidInput(f"timeout must be positive, got {timeout_s}")
        limit = self.config.request_timeout_s()
        return priority, arrival + min(timeout_s or limit, limit)

    def _enter(self) -> None:
        self._inflight += 1
        self.tally.inflight_changed()
        self._no_inflight.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        self.tally.inflight_changed()
        if self._inflight == 0:
            self._no_inflight.set()


def _logprobs(texts: TokenTexts, logprobs: TokenLogprobs | None, tokens: int) -> list[TokenLogprob]:
    """The first `tokens` rows of an engine's logprobs as `TokenLogprob`s."""
    if not tokens:
        return []
    if logprobs is None:  # never an answer with tokens silently missing from its logprobs
        raise BatchFailed(f"the engine sent {tokens} tokens without the logprobs the request asked for")
    ids, values = logprobs.arrays()
    entries = []
    for row_ids, row_values in zip(ids[:tokens].tolist(), values[:tokens].tolist(), strict=True):
        strings = texts.position(row_ids)
        top: dict[int, tuple[str, float]] = {}
        for token, text, value in zip(row_ids, strings, row_values, strict=True):
            top.setdefault(token, (text, value))
        entries.append(TokenLogprob(strings[0], row_values[0], list(top.values())))
    return entries
