"""Tokenization and detokenization in the front, without transformers or torch.

The engine hands over its tokenizer (`wire.TextSpec`): the fast tokenizer's JSON, rebuilt here with
`tokenizers.Tokenizer.from_str` (the same Rust code transformers calls, so the ids are the same), and the
chat template, rendered with Jinja in the sandbox and with the options transformers uses
(`apply_chat_template`: trim_blocks, lstrip_blocks, loop controls, `tojson`, `raise_exception`).

Generated ids become text incrementally (`tokenizers.decoders.DecodeStream`: each token costs the same
however long the output is), and `StopTracker` holds back what may be the start of a stop string.
`TokenTexts` gives each token's own text where a request asks for logprobs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from carpool.runtime.errors import InvalidInput
from carpool.runtime.wire import TextSpec


class TextCodec:
    """Text -> ids for encoders and prompts, chat messages -> ids, and ids -> text streams."""

    def __init__(self, spec: TextSpec) -> None:
        self.spec = spec
        self.tokenizer = Tokenizer.from_str(spec.tokenizer_json)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self._template = _compile(spec.chat_template) if spec.chat_template else None
        self._ascii = AsciiPath.of(spec.tokenizer_json)
        self._marker: tuple[str | None] | None = None
        """The tokenizer's Metaspace marker (`token_texts`), read from its JSON when first needed."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """With the model's special tokens, as `tokenizer(texts, add_special_tokens=True)`. Without the
        character offsets nothing here reads (`encode_batch_fast`: 46 us a text of the bench corpus for
        MiniLM against 54, the same ids). ASCII texts for a BERT-normalized tokenizer take `AsciiPath`
        (the same ids again, about 40% less time)."""
        tokenizer, texts = self._path(texts)
        return [
            encoding.ids for encoding in tokenizer.encode_batch_fast(list(texts), add_special_tokens=True)
        ]

    def encode_pairs(self, first: str, seconds: Sequence[str]) -> list[tuple[list[int], int]]:
        """Each text pair (`first`, a second) as `tokenizer(first, second)` tokenizes it (a cross-encoder's
        input), with the index where the second text's tokens begin: token type 1 from there on, as the
        tokenizer marks it (a tokenizer that gives no types: the length, all 0)."""
        tokenizer, texts = self._path([first, *seconds])
        first, seconds = texts[0], texts[1:]
        encodings = tokenizer.encode_batch([(first, second) for second in seconds], add_special_tokens=True)
        pairs = []
        for encoding in encodings:
            types = encoding.type_ids
            pairs.append((list(encoding.ids), types.index(1) if 1 in types else len(types)))
        return pairs

    def _path(self, texts: Sequence[str]) -> tuple[Tokenizer, Sequence[str]]:
        """The tokenizer for `texts` and the texts to give it: `AsciiPath`'s, normalized, where all of
        them can take it, else the tokenizer's own and the texts as they are."""
        folded = self._ascii.fold_all(texts) if self._ascii is not None else None
        if self._ascii is None or folded is None:
            return self.tokenizer, texts
        return self._ascii.tokenizer, folded

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """As `apply_chat_template(messages, add_generation_prompt=..., tokenize=True)`."""
        if self._template is None:
            raise InvalidInput("this model has no chat template: use /v1/completions with a prompt")
        try:
            rendered = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.spec.special_tokens
            )
        except TemplateError as exc:  # roles out of order, ...: the caller's to fix
            raise InvalidInput(f"messages do not fit the model's chat template: {exc}") from exc
        # The template writes the special tokens itself, so none are added around it.
        return list(self.tokenizer.encode(rendered, add_special_tokens=False).ids)

    def encode_plain(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """As vLLM's `/detokenize`: the text of `ids`, special tokens kept."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary writes it (`convert_ids_to_tokens`)."""
        return [self.tokenizer.id_to_token(token) or "" for token in ids]

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.tokenizer)

    def token_texts(self) -> TokenTexts:
        """Each generated token's own text, for one sequence's logprobs."""
        if self._marker is None:
            self._marker = (_leading_space_marker(self.spec.tokenizer_json),)
        return TokenTexts(self.tokenizer, self._marker[0])


class Detokenizer:
    """Ids -> text one token at a time (special tokens skipped); O(1) per token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, ids: Sequence[int]) -> str:
        pieces = [self._stream.step(self._tokenizer, token) for token in ids]
        return "".join(piece for piece in pieces if piece)


REPLACEMENT = "\ufffd"


class TokenTexts:
    """Token ids -> the text of each token alone, as vLLM's OpenAI server writes them in logprobs
    (`vllm.v1.engine.logprobs.LogprobsProcessor`): the decode of the single id with special tokens kept,
    the leading spaces a Metaspace (SentencePiece) tokenizer's decode drops put back, and a token that
    ends in an incomplete UTF-8 character decoded with the up to 4 sampled tokens before it (the text
    that completes the character; "" while it is still incomplete). One per sequence: it remembers the
    sampled tokens."""

    def __init__(self, tokenizer: Tokenizer, marker: str | None) -> None:
        self._tokenizer = tokenizer
        self._marker = marker
        self._context: list[int] = []
        """The last sampled ids, oldest first (at most 4)."""

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def _one(self, token: int) -> str:
        text = self._decode([token])
        if self._marker is None:
            return text
        raw = self._tokenizer.id_to_token(token) or ""
        markers = len(raw) - len(raw.lstrip(self._marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def position(self, ids: list[int]) -> list[str]:
        """The texts of one generated position's ids (the sampled one first, then the alternatives)."""
        texts = [self._one(token) for token in ids]
        for index, text in enumerate(texts):
            if text.endswith(REPLACEMENT):
                texts[index] = self._complete(ids[index])
        self._context = [*self._context[-3:], ids[0]]
        return texts

    def _complete(self, token: int) -> str:
        # vLLM's `_correct_decoded_token`, step for step.
        context = self._context
        for count in range(1, len(context) + 1):
            before = context[-count:]
            whole = self._decode([*before, token])
            if whole.endswith(REPLACEMENT):
                continue
            clean = len(before)
            for j in range(len(before) - 1, -1, -1):
                if not self._decode([before[j]]).endswith(REPLACEMENT):
                    break
                clean = j
            prefix = self._decode(before[:clean]) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix) :]
            common = 0
            for a, b in zip(prefix, whole, strict=False):
                if a != b:
                    break
                common += 1
            return whole[common:]
        return ""


def _leading_space_marker(tokenizer_json: str) -> str | None:
    """The replacement character of a Metaspace pre-tokenizer (SentencePiece's "▁"), else None (vLLM's
    `get_leading_space_marker`)."""
    pre = json.loads(tokenizer_json).get("pre_tokenizer") or {}
    candidates = [pre, *pre.get("pretokenizers", [])] if pre.get("type") == "Sequence" else [pre]
    for candidate in candidates:
        if candidate.get("type") == "Metaspace":
            return str(candidate.get("replacement", "\u2581"))
    return None


class StopTracker:
    """Turns text pieces into deltas safe to send: holds back what could be the start of a stop string
    or an incomplete character, and says when a stop string has appeared (the text ends before it)."""

    def __init__(self, stop: tuple[str, ...], min_tokens: int = 0) -> None:
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0
        self.text = ""
        self.stopped = False
        self.min_tokens = min_tokens
        """Pushes (tokens) before stop strings are looked for (vLLM's `min_tokens`: only in text that
        arrives once the output holds more tokens than that)."""
        self.pushed = 0

    def push(self, piece: str, tokens: int = 1) -> str:
        """Append `piece`, the text of `tokens` more tokens; returns the new text safe to send."""
        self.pushed += tokens
        if self.stopped or not piece:
            return ""
        start = max(0, len(self.text) - self.holdback)  # a stop string may straddle the old end
        self.text += piece
        looking = self.pushed > self.min_tokens
        ends = [at for s in self.stop if looking and (at := self.text.find(s, start)) != -1]
        if ends:
            self.text = self.text[: min(ends)]
            self.stopped = True
            return self.flush()
        safe = len(self.text) - self.holdback
        while safe > self.sent and self.text[safe - 1] == "\ufffd":
            safe -= 1  # an incomplete multi-byte character: wait for the next token
        if safe <= self.sent:
            return ""
        delta = self.text[self.sent : safe]
        self.sent = safe
        return delta

    def flush(self) -> str:
        """Everything not yet sent (at the end of the sequence)."""
        delta = self.text[self.sent :].rstrip("\ufffd")
        self.sent = len(self.text)
        return delta


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


_ASCII_CONTROL: dict[int, str | None] = dict.fromkeys([*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
_BERT_CLEAN = str.maketrans({**_ASCII_CONTROL, ord("\t"): " ", ord("\n"): " ", ord("\r"): " "})
"""`BertNormalizer(clean_text=True)` on ASCII: control characters dropped (vertical tab and form feed too:
Rust's `is_control` wins over its `is_whitespace` there), tab, newline and return made spaces."""


class AsciiPath:
    """The tokenizer's BERT normalizer done in Python for ASCII text, then the tokenizer without it.

    `tokenizers` normalizes a string keeping an alignment per character, which for BERT's normalizer
    (MiniLM, BGE, E5 and every BERT-family embedding model) costs about 40% of tokenizing a short text. On
    ASCII that normalizer is `str.lower` and a character table (no accents to strip, no CJK characters to
    space out), which Python's C code does in a fraction of that, and the same tokenizer with no
    normalizer then gives the same ids. A text that is not ASCII, or that holds an added token's text
    (matched before normalization when the token is not normalized), takes the tokenizer's own path."""

    def __init__(self, tokenizer: Tokenizer, fold: Callable[[str], str], added: re.Pattern[str] | None):
        self.tokenizer = tokenizer
        self.fold = fold
        self.added = added
        """Any added token's text, in any case: such a text goes the tokenizer's own way."""

    @classmethod
    def of(cls, tokenizer_json: str) -> AsciiPath | None:
        """For a tokenizer whose normalizer is `BertNormalizer`; None for any other."""
        config = json.loads(tokenizer_json)
        normalizer = config.get("normalizer")
        if not isinstance(normalizer, dict) or normalizer.get("type") != "BertNormalizer":
            return None
        fold = bert_ascii_fold(bool(normalizer.get("clean_text")), bool(normalizer.get("lowercase")))
        config["normalizer"] = None
        tokenizer = Tokenizer.from_str(json.dumps(config))
        tokenizer.no_truncation()
        tokenizer.no_padding()
        contents = [token["content"] for token in config.get("added_tokens") or [] if token.get("content")]
        added = re.compile("|".join(map(re.escape, contents)), re.IGNORECASE) if contents else None
        return cls(tokenizer, fold, added)

    def fold_all(self, texts: Sequence[str]) -> list[str] | None:
        """Every text normalized, or None when one of them must take the tokenizer's own path."""
        folded = []
        added = self.added
        for text in texts:
            if not text.isascii():
                return None
            done = self.fold(text)
            if added is not None and (added.search(text) or added.search(done)):
                return None
            folded.append(done)
        return folded


def bert_ascii_fold(clean_text: bool, lowercase: bool) -> Callable[[str], str]:
    """`BertNormalizer`'s work on an ASCII string (`handle_chinese_chars` and `strip_accents` change no
    ASCII character)."""
    if clean_text and lowercase:
        return lambda text: text.lower().translate(_BERT_CLEAN)
    if clean_text:
        return lambda text: text.translate(_BERT_CLEAN)
    if lowercase:
        return str.lower
    return lambda text: text


def _compile(template: str) -> Any:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(template)
