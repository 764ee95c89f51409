"""Text to token ids through a model folder's `tokenizer.json`, without transformers or torch.

The Rust `tokenizers` library behind every Hugging Face fast tokenizer does the work; calling it directly
skips the Python wrapper of `PreTrainedTokenizerFast.__call__`, which costs about three times the
tokenization of a short sentence. The ids are the same as the wrapper's with `add_special_tokens=True`
and no truncation (tests compare them on the served MiniLM). Truncation and padding that a
`tokenizer.json` may carry are switched off: an input that is too long is refused by the caller with the
numbers, never cut silently.

Used by the null engine (`models.null`), which has no transformers tokenizer to borrow, and by anything
that tokenizes where torch and transformers are not loaded. `tokenizer_json` is the one serialisation of a
tokenizer that the engines hand to the fronts (`models.text`, `wire.TextSpec`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from carpool.runtime.config import ConfigError

TOKENIZER_FILE = "tokenizer.json"


def read_json(folder: Path, name: str) -> dict[str, Any]:
    """A JSON object from `folder/name`; {} when the file is absent or holds something else."""
    try:
        data = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tokenizer_json(tokenizer: Tokenizer) -> str:
    """`tokenizer` serialised for `tokenizers.Tokenizer.from_str`, truncation and padding switched off
    (the fronts refuse an input that is too long with the numbers; they never cut it)."""
    serialised = json.loads(tokenizer.to_str())
    serialised["truncation"] = None
    serialised["padding"] = None
    return json.dumps(serialised)


class TextTokenizer:
    """Encodes texts to token ids with special tokens, never truncated nor padded."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer

    @classmethod
    def from_folder(cls, folder: str | Path) -> TextTokenizer:
        path = Path(folder) / TOKENIZER_FILE
        if not path.is_file():
            raise ConfigError(
                f"no {TOKENIZER_FILE} in {folder}: this needs a fast tokenizer's file (models saved by "
                "transformers >= 4 have one)"
            )
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust library raises a bare Exception on a malformed file
            raise ConfigError(f"{path} is not a tokenizer file the tokenizers library reads: {exc}") from exc

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if len(texts) == 1:  # encode_batch's thread pool costs more than it saves on one text
            return [self._tokenizer.encode(texts[0]).ids]
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def to_json(self) -> str:
        """This tokenizer as `tokenizer_json` serialises it."""
        return tokenizer_json(self._tokenizer)

    def special_ids(self) -> set[int]:
        return {int(i) for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}
