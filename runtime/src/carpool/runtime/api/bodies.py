"""Request bodies decoded and validated by msgspec, with errors that name the field as people write it.

msgspec validates a JSON body against a `msgspec.Struct` while it parses it, several times faster than
parsing to Python objects and validating them with pydantic, which matters on the hot path of an embedding
request. Its errors read `Expected `str`, got `int` - at `$.input[0]``; `BodyDecoder` turns them into
the messages the API has always given (`input[0]: Input should be a valid string, got int`, `inputs:
Extra inputs are not permitted`, `input[1] is an empty string`), raised as `InvalidBody` (400) whose
`param` names the field for the OpenAI error body.
"""

from __future__ import annotations

import re
from typing import Generic, TypeVar

import msgspec

from carpool.runtime.errors import InvalidInput

T = TypeVar("T")

_AT = re.compile(r"^(?P<text>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_TYPE = re.compile(r"^Expected `(?P<expected>[^`]+)`, got `(?P<got>[^`]+)`$")
_LENGTH = re.compile(r"^Expected `(?P<kind>[^`]+)` of length (?P<op>[<>]=?) (?P<n>\d+)$")
_BOUND = re.compile(r"^Expected `(?P<kind>[^`]+)` (?P<op>[<>]=?) (?P<n>\S+)$")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.+)$")

_TYPE_NAMES = {
    "str": "a valid string",
    "int": "a valid integer",
    "float": "a number",
    "bool": "a boolean",
    "null": "null",
    "array": "an array",
    "object": "a JSON object",
}
_OPS = {
    ">=": "greater than or equal to",
    ">": "greater than",
    "<=": "less than or equal to",
    "<": "less than",
}


class InvalidBody(InvalidInput):
    """A request body that does not match its schema (400); `param` is the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _join(where: str, field: str) -> str:
    return f"{where}.{field}" if where else field


def _choices(struct: type) -> dict[str, tuple[object, ...]]:
    """The allowed values of each `Literal` field of a Struct, by JSON name (for enum errors)."""
    info = msgspec.inspect.type_info(struct)
    found: dict[str, tuple[object, ...]] = {}
    for field in getattr(info, "fields", ()):
        kind: msgspec.inspect.Type = field.type
        while isinstance(kind, msgspec.inspect.Metadata):  # Annotated[..., Meta(...)]
            kind = kind.type
        options = kind.types if isinstance(kind, msgspec.inspect.UnionType) else (kind,)
        for option in options:
            if isinstance(option, msgspec.inspect.LiteralType):
                found[field.encode_name] = tuple(sorted(option.values, key=str))
    return found


def describe(error: str, choices: dict[str, tuple[object, ...]] | None = None) -> tuple[str, str]:
    """(message, field) for a msgspec validation error message; field is `body` for the whole body."""
    match = _AT.match(error)
    text, path = (match["text"], match["path"] or "") if match else (error, "")
    where = path.removeprefix(".")
    if found := _UNKNOWN.match(text):
        where = _join(where, found["field"])
        return f"{where}: Extra inputs are not permitted", where
    if found := _MISSING.match(text):
        where = _join(where, found["field"])
        return f"{where}: Field required", where
    where = where or "body"
    if found := _TYPE.match(text):
        wanted = " or ".join(_TYPE_NAMES.get(part, f"`{part}`") for part in found["expected"].split(" | "))
        return f"{where}: Input should be {wanted}, got {found['got']}", where
    if found := _LENGTH.match(text):
        kind, op, n = found["kind"], found["op"], int(found["n"])
        if kind == "str" and op == ">=" and n == 1:
            return f"{where} is an empty string", where
        unit = "character" if kind == "str" else "item"
        bound = "at least" if op.startswith(">") else "at most"
        return f"{where}: should have {bound} {n} {unit}{'s' if n != 1 else ''}", where
    if found := _BOUND.match(text):
        return f"{where}: Input should be {_OPS[found['op']]} {found['n']}", where
    if found := _ENUM.match(text):
        allowed = (choices or {}).get(where)
        if allowed:
            listed = ", ".join(repr(value) for value in allowed)
            return f"{where}: Input should be one of {listed}, got {found['value']}", where
        return f"{where}: invalid value {found['value']}", where
    return f"{where}: {text}", where


class BodyDecoder(Generic[T]):
    """Decodes a JSON body into `kind` (a msgspec Struct); raises `InvalidBody` with a clear message."""

    def __init__(self, kind: type[T]) -> None:
        self._decoder = msgspec.json.Decoder(kind)
        self._choices = _choices(kind)

    def decode(self, body: bytes) -> T:
        if not body.strip():
            raise InvalidBody("the request body is empty: send a JSON object", "body")
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            message, where = describe(str(exc), self._choices)
            raise InvalidBody(message, where) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            # Bytes that are not UTF-8 are named as such, however msgspec reports them (its releases
            # have raised UnicodeDecodeError, and DecodeError "Invalid UTF-8 encoded string").
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise InvalidBody(f"the request body is not valid UTF-8 JSON: {bad.reason}", "body") from None
            raise InvalidBody(f"the request body is not valid JSON: {exc}", "body") from None


def schema(kind: type) -> dict[str, object]:
    """The JSON schema of a Struct without nested definitions, for an OpenAPI request body."""
    document = msgspec.json.schema(kind)
    definitions: dict[str, dict[str, object]] = document.get("$defs", {})
    if len(definitions) != 1:
        raise ValueError(f"{kind.__name__} nests other structs: its schema needs components")
    (only,) = definitions.values()
    return only
