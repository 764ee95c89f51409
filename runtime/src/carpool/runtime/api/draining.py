"""Ends keep-alive connections once the server drains, so that clients stop reusing them before it exits.

Without it, a client whose request was answered during the drain sends its next request on the same
connection; if the drain has just finished, the server closes that connection as it exits and the client
sees it dropped without an answer (and cannot know the request never ran). With `Connection: close` on
every response after SIGTERM, the next request opens a new connection: it is refused with 503 while the
server still listens, or not connected once it has gone, both of which a client or load balancer retries.
"""

from __future__ import annotations

from starlette.types import Message

from carpool.runtime.api.frontend import Frontend
from carpool.runtime.wire import EngineState

_ENDING = (EngineState.DRAINING, EngineState.STOPPED)


def is_draining(service: Frontend) -> bool:
    return service.state in _ENDING


def with_connection_close(message: Message) -> Message:
    """A copy of an `http.response.start` message whose headers say `Connection: close`."""
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}
