"""HTTPS for the API port: `server.tls` as the keyword arguments uvicorn takes.

Kept apart from `api.process` (which starts each front process's uvicorn) so that whoever starts uvicorn
passes the same settings, and so the mapping is tested without a server. uvicorn builds the SSL context
from these files at start-up; `reload_certificates` (which each front runs beside uvicorn) loads a renewed
certificate into that context, so cert-manager's renewals are served without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import Any

import uvicorn

from carpool.runtime.config import ServerConfig

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
"""How often the certificate files are checked for a renewal."""


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


def file_identity(*paths: str) -> tuple[tuple[int, int, int, int], ...]:
    stats = [os.stat(path) for path in paths]  # follows a Secret volume's `..data` symlink
    return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) for st in stats)


async def reload_certificates(config: uvicorn.Config, interval_s: float = CHECK_INTERVAL_S) -> None:
    """Keep a running server's certificate current: when the certificate or key file changes (cert-manager
    renewed it and the kubelet swapped the mounted Secret), load the new pair into the server's SSL
    context, which every new handshake uses; open connections keep the old one. A pair that does not
    load (a key that does not match, a file half-written by hand) keeps the current one, with a warning,
    and is tried again at the next check. Runs until cancelled; returns at once for plain HTTP."""
    if not (config.ssl_certfile and config.ssl_keyfile):
        return
    files = (str(config.ssl_certfile), str(config.ssl_keyfile))
    try:
        current = file_identity(*files)
    except OSError:
        current = ()
    warned = ""
    while True:
        await asyncio.sleep(interval_s)
        context = config.ssl if config.loaded else None
        if context is None:
            continue
        try:
            seen = file_identity(*files)
            if seen == current:
                continue
            context.load_cert_chain(*files, password=config.ssl_keyfile_password)
        except (OSError, ssl.SSLError) as exc:
            message = f"cannot load the TLS certificate {files[0]} ({exc}); serving the previous one"
            if message != warned:
                log.warning(message)
                warned = message
            continue
        current, warned = seen, ""
        log.info("TLS certificate reloaded from %s", files[0])
