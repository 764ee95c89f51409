"""JSON responses serialised by orjson, numpy arrays included (embeddings are float32 rows)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


class JSONBody(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
