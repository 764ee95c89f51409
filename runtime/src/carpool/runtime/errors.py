"""Domain errors of the runtime. The core raises these; `api.errors` maps each to an HTTP status.

Each carries a message written for the caller: what was wrong and what the limit is.
"""

from __future__ import annotations


class CarpoolError(Exception):
    """Base of every error the runtime reports to a caller."""

    retry_after_s: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(CarpoolError):
    """The request is malformed or exceeds a limit (400)."""


class InputTooLong(InvalidInput):
    """An input has more tokens than the model accepts (400)."""


class InvalidAdapter(InvalidInput):
    """A LoRA adapter that cannot be served on this base model: files missing, wrong base, rank over the
    limit, an unsupported feature, a name already taken (400)."""


class Forbidden(CarpoolError):
    """The server's configuration does not allow this request (403)."""


class ModelNotFound(CarpoolError):
    """The request names a model this server does not serve (404)."""


class QueueFull(CarpoolError):
    """Admitting the request would exceed the queue limit (429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(CarpoolError):
    """The model is loading, warming up or draining (503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(CarpoolError):
    """The request waited past its deadline and was never run (504)."""


class Cancelled(CarpoolError):
    """The caller went away before its request ran (the client never sees this; logged as 499)."""


class OutOfMemory(CarpoolError):
    """The device ran out of memory for this input even in a batch of its own (500)."""


class BatchFailed(CarpoolError):
    """The model raised while running the batch holding this request (500)."""


STATUS: dict[type[CarpoolError], int] = {
    InvalidInput: 400,
    Forbidden: 403,
    ModelNotFound: 404,
    QueueFull: 429,
    Cancelled: 499,
    BatchFailed: 500,
    OutOfMemory: 500,
    NotReady: 503,
    DeadlineExceeded: 504,
}
"""The HTTP status of each domain error (the fronts' `api.errors`, and vLLM's surface, answer with it)."""


def status_of(exc: CarpoolError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500
