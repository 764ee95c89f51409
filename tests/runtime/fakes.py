"""A scripted engine for testing batching mechanics over real HTTP without a model's run time.

It implements the same `Engine` protocol as the transformers engines, tokenizer included (a word-level
`tokenizers` tokenizer that the fronts rebuild from its JSON, as they do a real model's). Each word is one
token; the "embedding" of a text is [number of tokens, sum of token ids], so every caller can check that
it got its own answer back. `gate` holds forward passes until released, so tests can build a queue on
purpose (across processes: forward passes wait while the file `gate_file` exists); texts containing
"boom" make their batch raise; a text containing "crash" gets back a row the engine's
post-processing cannot turn into an array (an error in the engine's loop, outside the model call);
`oom_above` makes batches larger than that run out of memory.

`scripted_engine` builds one inside an engine process, from options in the CARPOOL_FAKE_ENGINE variable.
"""

from __future__ import annotations

import json
import os
import string
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing

from carpool.runtime.batching.continuous import StepPlan
from carpool.runtime.config import RuntimeConfig, Task
from carpool.runtime.errors import OutOfMemory
from carpool.runtime.models.base import EngineInfo, TextSpec
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.wire import TokenLogprobs

BOOM = 999_999
GENERATED = 64
"""ScriptedGenerator's n-th token is the word `t<n>` (the last repeats past this)."""
WORDS = (
    "hello world fine still serving first text number too late early low high gone away boom token ok "
    "ride share requests slow fast stream bye crash"
)


class Unstackable:
    """A model output that raises when the engine turns it into an array (see "crash")."""

    def __array__(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError("a post-processing bug on purpose")


def token_of(word: str) -> int:
    return 100 + zlib.crc32(word.encode()) % 10_000


def word_tokenizer() -> Tokenizer:
    """Words of the tests (and single letters, numbers up to 999) are one token each; others are [UNK]."""
    words = set(string.ascii_lowercase) | {str(n) for n in range(1000)} | set(WORDS.split())
    words |= {f"t{n}" for n in range(GENERATED)}  # what ScriptedGenerator says
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "boom": BOOM}
    taken = set(vocab.values())
    for word in sorted(words - {"boom"}):
        token = token_of(word)
        while token in taken:  # ids must be unique for the tokenizer to survive its JSON round trip
            token += 1
        vocab[word] = token
        taken.add(token)
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    return tokenizer


_TOKENIZER = word_tokenizer()


def tokenize(text: str) -> list[int]:
    return list(_TOKENIZER.encode(text).ids)


def expected_embedding(text: str) -> list[float]:
    tokens = tokenize(text)
    return [float(len(tokens)), float(sum(tokens))]


class ScriptedEngine:
    def __init__(
        self,
        max_input_tokens: int = 64,
        oom_above: int | None = None,
        gate_file: str | None = None,
        labels: list[str] | None = None,
    ) -> None:
        """With `labels` (two of them), a classifier whose "probabilities" are the embedding above."""
        self._info = EngineInfo(
            name="fake",
            task=Task.CLASSIFY if labels else Task.EMBED,
            max_input_tokens=max_input_tokens,
            device="cpu",
            dtype="float32",
            source="fake",
            dimensions=None if labels else 2,
            labels=labels or [],
        )
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.batches: list[list[list[int]]] = []
        self.attempts: list[list[list[int]]] = []
        self.oom_above = oom_above
        self.lock = threading.Lock()
        self.gate_file = Path(gate_file) if gate_file else None
        self.threads: list[int] = []
        """The thread of every forward pass, warm-up included."""

    @property
    def info(self) -> EngineInfo:
        return self._info

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [tokenize(text) for text in texts]

    def text_spec(self) -> TextSpec:
        return TextSpec(tokenizer_json=_TOKENIZER.to_str())

    def dummy_input(self, length: int) -> list[int]:
        return [1] + [5] * max(0, length - 2) + [2]

    def release_memory(self) -> None:
        pass

    def forward(self, batch: Sequence[Sequence[int]]) -> Sequence[Any]:
        with self.lock:
            self.threads.append(threading.get_ident())
        self.entered.release()
        self.gate.wait(timeout=30)
        deadline = time.monotonic() + 30
        while self.gate_file is not None and self.gate_file.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        with self.lock:
            self.attempts.append([list(ids) for ids in batch])  # every pass, the failed ones included
        if self.oom_above is not None and len(batch) > self.oom_above:
            raise OutOfMemory("fake device out of memory")
        with self.lock:
            self.batches.append([list(ids) for ids in batch])
        if any(BOOM in ids for ids in batch):
            raise RuntimeError("the model exploded on purpose")
        crash = _TOKENIZER.token_to_id("crash")
        return [
            Unstackable() if crash in ids else np.array([len(ids), sum(ids)], dtype=np.float32)
            for ids in batch
        ]

    def served_batches(self) -> list[list[list[int]]]:
        """Batches run after warm-up (warm-up inputs are all 5s)."""
        with self.lock:
            return [b for b in self.batches if not all(set(ids[1:-1]) <= {5} for ids in b)]


def factory(engine: ScriptedEngine | ScriptedGenerator) -> Any:
    def build(config: RuntimeConfig) -> ScriptedEngine | ScriptedGenerator:
        return engine

    return build


def scripted_engine(config: RuntimeConfig) -> ScriptedEngine:
    """The engine factory a real engine process imports (`tests.runtime.fakes:scripted_engine`); options
    come from CARPOOL_FAKE_ENGINE (JSON), and `pid_file` gets the engine process's pid."""
    options = json.loads(os.environ.get("CARPOOL_FAKE_ENGINE", "{}"))
    pid_file = options.pop("pid_file", None)
    if pid_file:
        Path(pid_file).write_text(str(os.getpid()))
    return ScriptedEngine(**options)


EOS = 3


class ScriptedGenerator:
    """A generative engine whose output is known in advance: the n-th generated token is the word `t<n>`,
    and a prompt holding the word "bye" ends with end of text after two tokens. It takes its tokenizer from
    `word_tokenizer`, so the fronts encode and decode as they would a real model's. `gate` holds steps
    until released."""

    def __init__(self, max_model_len: int = 256, num_blocks: int = 64, block_size: int = 8) -> None:
        self.eos_ids = {EOS}
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.params: dict[int, SamplingParams] = {}
        self.forgotten: list[int] = []
        self.logprobs: dict[int, TokenLogprobs] = {}
        self.gate = threading.Event()
        self.gate.set()
        self._info = EngineInfo(
            name="fake",
            task=Task.GENERATE,
            max_input_tokens=max_model_len,
            device="cpu",
            dtype="float32",
            source="fake",
        )

    @property
    def info(self) -> EngineInfo:
        return self._info

    def encode(self, prompt: str) -> list[int]:
        return list(_TOKENIZER.encode(prompt, add_special_tokens=False).ids)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(" ".join(f"{m['role']} {m['content']}" for m in messages))

    def decode(self, ids: list[int]) -> str:
        return str(_TOKENIZER.decode(ids))

    def text_spec(self) -> TextSpec:
        return TextSpec(
            tokenizer_json=_TOKENIZER.to_str(),
            # Each message's role and content in a row: a chat of empty messages still has tokens.
            chat_template="{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}",
            eos_ids=[EOS],
            max_model_len=self.max_model_len,
            cache_tokens=self.num_blocks * self.block_size,
        )

    def dummy_prompt(self, length: int) -> list[int]:
        return [token_of("ok")] * length

    def step(self, plan: StepPlan, params: dict[int, SamplingParams]) -> dict[int, int]:
        self.gate.wait(timeout=30)
        self.params.update(params)
        sampled = {}
        bye = token_of("bye")
        for work in plan.work:
            if work.sample:
                seq = work.seq
                done = bye in seq.tokens and len(seq.output) >= 2
                said = min(len(seq.output), GENERATED - 1)
                sampled[seq.seq] = EOS if done else self.encode(f"t{said}")[0]
        # Made-up log-probabilities where asked: the sampled token at -0.5, then it and the tokens after
        # it in the vocabulary, each one lower.
        self.logprobs = {}
        for sid, token in sampled.items():
            n = self.params[sid].logprobs if sid in self.params else None
            if n is not None:
                ids = np.array([[token] + [token + k for k in range(n)]])
                values = np.array([[-0.5] + [-0.5 - k for k in range(n)]])
                self.logprobs[sid] = TokenLogprobs.of(ids, values)
        return sampled

    def forget(self, seq_id: int) -> None:
        self.forgotten.append(seq_id)

    def release_memory(self) -> None:
        pass
