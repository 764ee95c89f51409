"""The gRPC port's API keys and TLS: the same keys file and certificates as the HTTP port.

Keys: a server interceptor, installed only when `server.api_keys_file` is set, checks the
`authorization: Bearer <key>` metadata of every call (deny by default, as `api.auth` on HTTP) against the
front's one `KeyFile` (so a rotated Secret reaches both protocols at once). Open without a key, like the
HTTP health paths: `grpc.health.v1.Health` and the v2 ServerLive and ServerReady (the kubelet's `grpc`
probes and tritonclient's `is_server_live/ready` carry no credentials). A refusal is UNAUTHENTICATED,
counted by reason in `carpool_auth_refusals_total{protocol="grpc"}` and, for ModelInfer, in
`carpool_requests_total` as 401.

TLS: `server.tls`'s certificate and key (and client CA for mutual TLS) as gRPC server credentials whose
certificate is fetched again at each handshake when the files changed, so a renewal (cert-manager, a
Secret's symlink swap) is served without a restart, as `tls.reload_certificates` does for HTTPS. A pair
that does not load keeps the previous one, with a warning.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from carpool.runtime.api.auth import bearer_token
from carpool.runtime.api.keys import KeyFile
from carpool.runtime.config import TLSConfig
from carpool.runtime.tls import file_identity

log = logging.getLogger(__name__)

INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
OPEN_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
    }
)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(
        self, keys: KeyFile, count: Callable[[int, str], None], refused: Callable[[str, str], None]
    ) -> None:
        self.keys = keys
        self.count = count
        self.refused = refused

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        if details.method in OPEN_METHODS:
            return await continuation(details)
        token = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                token = bearer_token(str(value))
        if token is not None and self.keys.accepts(token):
            return await continuation(details)
        if token is None:
            message, reason = (
                "missing API key: send the metadata 'authorization: Bearer <key>'",
                "missing_key",
            )
        else:
            message, reason = "invalid API key", "invalid_key"
        log.debug("UNAUTHENTICATED %s: %s", details.method, message)
        self.refused(reason, "grpc")
        if details.method == INFER_METHOD:
            self.count(401, "grpc")

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return grpc.unary_unary_rpc_method_handler(deny)


def _configuration(tls: TLSConfig) -> Any:
    cert, key = tls.cert_file.read_bytes(), tls.key_file.read_bytes()
    # Load the pair the way the HTTP port does, so a key that does not match its certificate is refused
    # here rather than at every handshake.
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls.cert_file, tls.key_file)
    roots = tls.client_ca_file.read_bytes() if tls.client_ca_file is not None else None
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=roots)


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Credentials that present `tls`'s certificate, reloaded when its files change."""
    files = [str(tls.cert_file), str(tls.key_file)]
    if tls.client_ca_file is not None:
        files.append(str(tls.client_ca_file))
    state = {"identity": file_identity(*files), "warned": ""}
    initial = _configuration(tls)

    def fetch() -> Any:  # called by gRPC at each new handshake: None keeps the current certificate
        try:
            seen = file_identity(*files)
            if seen == state["identity"]:
                return None
            configuration = _configuration(tls)
        except (OSError, ssl.SSLError) as exc:
            message = f"cannot load the TLS certificate {files[0]} ({exc}); serving the previous one"
            if message != state["warned"]:
                log.warning(message)
                state["warned"] = message
            return None
        state["identity"], state["warned"] = seen, ""
        log.info("TLS certificate reloaded from %s (gRPC)", files[0])
        return configuration

    return grpc.dynamic_ssl_server_credentials(
        initial, fetch, require_client_authentication=tls.client_ca_file is not None
    )
