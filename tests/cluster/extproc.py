"""A gateway's part against the endpoint picker (EPP), in Envoy's ext_proc protocol (gRPC, from Envoy's own
protos in the `xds-protos` package): what kgateway's or Istio's Envoy does for a request an HTTPRoute sends
to an InferencePool, since Envoy itself cannot be built here.

Per request, one `ExternalProcessor.Process` stream, in the order Envoy sends with the picker's processing
mode (request headers, then the buffered body; after the upstream answered, its headers and body):

1. `request_headers` (`:method`, `:path`, `content-type`, `x-request-id`), then `request_body` with
   `end_of_stream`; the picker answers a headers response whose header mutation sets
   `x-gateway-destination-endpoint` to `<pod IP>:<port>` (and the same under the dynamic metadata
   namespace `envoy.lb`, which Envoy's original-destination cluster reads), then the body it forwards
   (streamed body mutations up to `end_of_stream`); or, when it cannot pick (no pod, a request it
   refuses), an `immediate_response` with the HTTP status the gateway returns instead.
2. The gateway sends the request to that endpoint (`Decision.forward`, over plain HTTP as Envoy does
   to a pool's pods) and reports the answer back: `response_headers` (`:status`, `content-type`), then
   `response_body` with `end_of_stream`, each answered by the picker; then it half-closes the stream,
   which ends the picker's bookkeeping of the request (its running-request count).
"""

from __future__ import annotations

import json
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Where the picker tells the gateway to send the request (the Gateway API Inference Extension's protocol)."""
LB_METADATA = "envoy.lb"
"""The dynamic metadata namespace that carries the same endpoint for Envoy's load balancer."""
RECEIVE_TIMEOUT_S = 30.0
"""Longest the picker may take to answer one message of a stream, by default (Envoy's `message_timeout`, per
message too: 200 ms by default, at most 3600 s; a gateway in front of a picker that holds requests, its
flow control, must wait longer than the hold). The stream itself lives as long as the request, upstream
included, as Envoy's does."""
STREAM_TIMEOUT_S = 600.0
"""A backstop for a whole stream, far past any request of the tier (a held pod may answer late)."""


class PickerError(AssertionError):
    pass


_END = object()


@dataclass
class _Stream:
    """One ext_proc stream: the messages Envoy sends, and the picker's answers, read as they come."""

    message_timeout_s: float = RECEIVE_TIMEOUT_S

    outgoing: queue.Queue[ext_proc.ProcessingRequest | None] = field(default_factory=queue.Queue)
    received: queue.Queue[object] = field(default_factory=queue.Queue)

    def requests(self) -> Iterator[ext_proc.ProcessingRequest]:
        while (message := self.outgoing.get()) is not None:
            yield message

    def start(self, answers: Iterator[ext_proc.ProcessingResponse]) -> None:
        def read() -> None:
            try:
                for answer in answers:
                    self.received.put(answer)
            except grpc.RpcError as exc:
                self.received.put(exc)
            self.received.put(_END)

        threading.Thread(target=read, name="ext-proc-answers", daemon=True).start()

    def send(self, message: ext_proc.ProcessingRequest) -> None:
        self.outgoing.put(message)

    def _next(self) -> object:
        try:
            item = self.received.get(timeout=self.message_timeout_s)
        except queue.Empty:
            raise PickerError(f"the picker sent no answer within {self.message_timeout_s:.0f} s") from None
        if isinstance(item, grpc.RpcError):
            raise item
        return item

    def receive(self) -> ext_proc.ProcessingResponse:
        item = self._next()
        if item is _END:
            raise PickerError("the picker closed the stream before answering")
        assert isinstance(item, ext_proc.ProcessingResponse)
        return item

    def close(self) -> None:
        """Half-close (Envoy is done with the request), then read the picker's end of the stream."""
        self.outgoing.put(None)
        while self._next() is not _END:
            pass


def _headers(pairs: dict[str, str], end_of_stream: bool) -> ext_proc.HttpHeaders:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end_of_stream)


def _set_headers(common: ext_proc.CommonResponse) -> dict[str, str]:
    return {
        option.header.key: option.header.raw_value.decode() or option.header.value
        for option in common.header_mutation.set_headers
    }


def _streamed_body(stream: _Stream, phase: str) -> bytes:
    """The picker's body mutations for `phase` (`request_body` or `response_body`), up to end of stream."""
    body = b""
    while True:
        answer = stream.receive()
        if answer.WhichOneof("response") != phase:
            raise PickerError(f"expected the picker's {phase} answer, got {answer}")
        mutation = getattr(answer, phase).response.body_mutation
        if mutation.WhichOneof("mutation") == "streamed_response":
            body += bytes(mutation.streamed_response.body)
            if mutation.streamed_response.end_of_stream:
                return body
        elif mutation.WhichOneof("mutation") == "body":
            return body + bytes(mutation.body)
        else:
            return body  # no mutation: the body goes on as it was sent


@dataclass
class Decision:
    """The picker's answer to one request, and what the gateway does with it."""

    endpoint: str
    """`<pod IP>:<port>` from the `x-gateway-destination-endpoint` header the picker set."""
    lb_endpoint: str
    """The same from the dynamic metadata (`envoy.lb`)."""
    headers: dict[str, str]
    """Every header the picker set (the gateway forwards them)."""
    body: bytes
    """The body the picker passes on."""
    path: str
    _stream: _Stream
    _done: bool = False

    def _forwarded(self) -> dict[str, str]:
        """The headers the gateway sends on: the picker's, less pseudo-headers and the destination."""
        return {k: v for k, v in self.headers.items() if not k.startswith(":") and k != DESTINATION_HEADER}

    def forward(self, client: httpx.Client) -> httpx.Response:
        """Send the request to the chosen endpoint, as the gateway does, and report the answer back."""
        answer = client.post(
            f"http://{self.endpoint}{self.path}", content=self.body, headers=self._forwarded()
        )
        self.report(answer.status_code, answer.headers.get("content-type", ""), answer.content)
        return answer

    def forward_streaming(
        self, client: httpx.Client, on_line: Callable[[str], None] | None = None
    ) -> tuple[int, list[str]]:
        """`forward` for a streaming request: the answer's status and lines, each passed to `on_line` as it
        arrives (server-sent events, relayed as they come, as Envoy does)."""
        lines: list[str] = []
        url = f"http://{self.endpoint}{self.path}"
        with client.stream("POST", url, content=self.body, headers=self._forwarded()) as answer:
            for line in answer.iter_lines():
                lines.append(line)
                if on_line is not None:
                    on_line(line)
            content_type = answer.headers.get("content-type", "")
        self.report(answer.status_code, content_type, "\n".join(lines).encode())
        return answer.status_code, lines

    def report(self, status: int, content_type: str, body: bytes) -> None:
        """The upstream's answer to the picker (response headers and body), then the end of the stream."""
        if self._done:
            return
        self._done = True
        stream = self._stream
        headers = {":status": str(status), "content-type": content_type}
        stream.send(ext_proc.ProcessingRequest(response_headers=_headers(headers, end_of_stream=False)))
        answer = stream.receive()
        if answer.WhichOneof("response") != "response_headers":
            raise PickerError(f"expected the picker's response_headers answer, got {answer}")
        stream.send(
            ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=body, end_of_stream=True))
        )
        _streamed_body(stream, "response_body")
        stream.close()


@dataclass(frozen=True)
class Refusal:
    """The picker's immediate response: the status the gateway answers with instead of routing."""

    status: int
    body: str


class Gateway:
    """ext_proc calls to one picker over TLS (verified against `ca`, the tier's CA that signed it)."""

    def __init__(
        self,
        target: str,
        ca: Path,
        server_name: str = "localhost",
        message_timeout_s: float = RECEIVE_TIMEOUT_S,
    ) -> None:
        self.message_timeout_s = message_timeout_s
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
        options = [("grpc.ssl_target_name_override", server_name)]
        self.channel = grpc.secure_channel(target, credentials, options=options)
        self.stub = ext_proc_grpc.ExternalProcessorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def pick(self, body: dict[str, Any], path: str = "/v1/completions") -> Decision | Refusal:
        """Send one request's headers and body; the picker's decision (or refusal)."""
        stream = _Stream(message_timeout_s=self.message_timeout_s)
        stream.start(iter(self.stub.Process(stream.requests(), timeout=STREAM_TIMEOUT_S)))
        data = json.dumps(body).encode()
        headers = {
            ":method": "POST",
            ":path": path,
            ":authority": "gateway.local",
            "content-type": "application/json",
            "x-request-id": str(uuid.uuid4()),
        }
        stream.send(ext_proc.ProcessingRequest(request_headers=_headers(headers, end_of_stream=False)))
        stream.send(ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=data, end_of_stream=True)))
        answer = stream.receive()
        kind = answer.WhichOneof("response")
        if kind == "immediate_response":
            stream.close()
            refusal = answer.immediate_response
            return Refusal(int(refusal.status.code), refusal.body.decode(errors="replace"))
        if kind != "request_headers":
            raise PickerError(f"expected the picker's request_headers answer, got {answer}")
        set_headers = _set_headers(answer.request_headers.response)
        lb = answer.dynamic_metadata.fields[LB_METADATA].struct_value.fields[DESTINATION_HEADER]
        forwarded = _streamed_body(stream, "request_body") or data
        return Decision(
            endpoint=set_headers.get(DESTINATION_HEADER, ""),
            lb_endpoint=lb.string_value,
            headers=set_headers,
            body=forwarded,
            path=path,
            _stream=stream,
        )
