"""HTTPS for the API port: `server.tls` as the keyword arguments uvicorn takes.

Kept apart from `server.py` (which starts the processes) so that whoever starts uvicorn passes the same
settings, and so the mapping is tested without a server. uvicorn builds the SSL context from these
files once, at start-up: a renewed certificate (cert-manager rewrites the mounted Secret) is served
after the pod restarts.
"""

from __future__ import annotations

import ssl
from typing import Any

from carpool.runtime.config import ServerConfig


def uvicorn_tls(server: ServerConfig) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for `server.tls`; empty for plain HTTP."""
    if server.tls is None:
        return {}
    options: dict[str, Any] = {
        "ssl_certfile": str(server.tls.cert_file),
        "ssl_keyfile": str(server.tls.key_file),
    }
    if server.tls.client_ca_file is not None:
        # Mutual TLS: a client without a certificate signed by one of these CAs fails the handshake.
        options["ssl_ca_certs"] = str(server.tls.client_ca_file)
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return options
