"""API keys, the metrics port and HTTPS over real loopback HTTP, with the scripted engine.

Every route the app serves is enumerated from the app itself, so a route added later cannot slip
through unprotected: without a key each answers 401 except the health paths (and /metrics while it
shares the API port).
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Route
from tritonclient.utils import InferenceServerException

from carpool.runtime.api.app import create_app
from carpool.runtime.api.client import EngineClient
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.api.keys import KeyFileError
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.tls import uvicorn_tls
from carpool.runtime.wire import Addresses
from tests.runtime.conftest import serve, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, expected_embedding, factory

KEY = "sk-carpool-0123456789abcdef"
OTHER = "sk-carpool-fedcba9876543210"
OPEN = {"/v2/health/live", "/v2/health/ready"}


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _config(tmp_path: Path, keys: str | None = KEY, **server: Any) -> RuntimeConfig:
    if keys is not None:
        (tmp_path / "keys").write_text(keys + "\n")
        server.setdefault("api_keys_file", str(tmp_path / "keys"))
    return runtime_config(
        model={"name": "fake"},
        batching={"max_batch_size": 8, "max_queue_size": 16, "batch_window_ms": 0},
        warmup={"batch_sizes": [1], "sequence_lengths": [4]},
        server=server,
    )


class Server:
    def __init__(self, url: str, app: Any, verify: ssl.SSLContext | bool = True) -> None:
        self.url = url
        self.app = app
        self.client = httpx.Client(base_url=url, timeout=60, verify=verify)

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        return self.client.get(path, headers=_bearer(key))

    def post(self, path: str, body: Any, key: str | None = None) -> httpx.Response:
        return self.client.post(path, json=body, headers=_bearer(key))


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


@contextmanager
def running(config: RuntimeConfig, verify: ssl.SSLContext | bool = True) -> Iterator[Server]:
    """The app under a front process's server (`api.process`: its TLS settings, certificate reloads and
    drain) over the wire to an engine core, on a loopback port."""
    with serve(config, factory(ScriptedEngine()), as_front=True) as front:
        # The routes are enumerated on the FastAPI app inside the front door.
        handle = Server(front.url, front.app.app, verify)
        try:
            yield handle
        finally:
            handle.client.close()


def _frontend(config: RuntimeConfig, folder: Path) -> Frontend:
    """A front's service, not started: enough to build its app."""
    return Frontend(config, EngineClient(Addresses.in_folder(str(folder), 1), 0))


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[Server]:
    with running(_config(tmp_path)) as server:
        yield server


EMBED = {"input": ["a b"], "model": "fake"}
INFER = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a b"]}]}


def _routes(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, set[str]]]:
    """(path, methods) of every route, through included routers (FastAPI wraps them) and mounts."""
    for route in routes:
        if isinstance(route, Route):
            yield prefix + route.path, set(route.methods or {"GET"})
        elif hasattr(route, "original_router"):  # FastAPI >= 0.165 keeps included routers whole
            yield from _routes(route.original_router.routes, prefix + route.include_context.prefix)
        elif hasattr(route, "routes"):  # a Mount
            yield from _routes(route.routes, prefix + route.path)
        else:
            raise AssertionError(f"cannot enumerate a route of type {type(route).__name__}")


def _requests(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, path parameters filled with the served model's name."""
    calls = []
    for path, methods in _routes(app.routes):
        for method in sorted(methods - {"HEAD"}):
            calls.append((method, re.sub(r"\{[^}]+\}", "fake", path)))
    return calls


# -- what is protected and what is open --------------------------------------------------------------


def test_every_route_but_health_needs_a_key(keyed: Server) -> None:
    calls = _requests(keyed.app)
    paths = {path for _, path in calls}
    # The enumeration must see the inference and metadata routes of both protocols (and FastAPI's own).
    assert {
        "/v1/embeddings",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v2",
        "/v2/models/fake",
        "/v2/models/fake/ready",
        "/v2/models/fake/infer",
        "/openapi.json",
        "/metrics",
    } <= paths
    for method, path in calls:
        bare = keyed.client.request(method, path, json={})
        with_key = keyed.client.request(method, path, json={}, headers=_bearer(KEY))
        if path in OPEN | {"/metrics"}:
            assert bare.status_code == 200, (method, path, bare.text)
            continue
        assert bare.status_code == 401, (method, path, bare.status_code)
        assert bare.headers["www-authenticate"] == 'Bearer realm="carpool"'
        assert with_key.status_code != 401, (method, path)
        wrong = keyed.client.request(method, path, json={}, headers=_bearer(OTHER))
        assert wrong.status_code == 401, (method, path)
        assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    # A path no route serves is refused before routing: unauthenticated callers cannot map the API.
    assert keyed.get("/v1/nothing-here").status_code == 401
    assert keyed.get("/v1/nothing-here", KEY).status_code == 404


def test_keyed_requests_are_served_and_refusals_say_why_in_each_protocols_shape(keyed: Server) -> None:
    ok = keyed.post("/v1/embeddings", EMBED, KEY)
    assert ok.status_code == 200 and ok.json()["data"][0]["embedding"] == expected_embedding("a b")
    assert keyed.post("/v2/models/fake/infer", INFER, KEY).status_code == 200
    assert keyed.client.post(
        "/v1/embeddings", json=EMBED, headers={"authorization": f"bearer {KEY}"}
    ).is_success

    openai_error = keyed.post("/v1/embeddings", EMBED).json()["error"]
    assert openai_error["type"] == "authentication_error" and openai_error["code"] == 401
    assert "Authorization: Bearer" in openai_error["message"]
    assert keyed.post("/v1/embeddings", EMBED, OTHER).json()["error"]["message"] == "invalid API key"
    assert keyed.post("/v2/models/fake/infer", INFER).json() == {
        "error": "missing API key: send the header 'Authorization: Bearer <key>'"
    }
    for header in ({"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}):
        assert keyed.client.post("/v1/embeddings", json=EMBED, headers=header).status_code == 401, header


def _counted(server: Server, name: str, **labels: str) -> float:
    """The sum of the samples of `name` with `labels` in a (keyed) scrape."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(server.get("/metrics", KEY).text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def test_refused_inference_requests_are_counted_as_401(keyed: Server) -> None:
    def requests(status: str) -> float:
        return _counted(keyed, "carpool_requests_total", status=status)

    assert keyed.post("/v1/embeddings", EMBED).status_code == 401  # the hot route's own check
    assert keyed.post("/v2/models/fake/infer", INFER, OTHER).status_code == 401  # the app's middleware
    assert keyed.post("/v1/embeddings", EMBED, KEY).status_code == 200
    assert keyed.get("/v2/models/fake").status_code == 401  # not an inference request: not counted
    assert requests("401") == 2 and requests("200") == 1


def test_every_refusal_is_counted_by_reason_whatever_the_path(keyed: Server) -> None:
    """`carpool_auth_refusals_total`: what an alert on key guessing (or a client left with a revoked key)
    watches, metadata and unknown paths included."""

    def refusals(reason: str) -> float:
        return _counted(keyed, "carpool_auth_refusals_total", reason=reason)

    assert keyed.post("/v1/embeddings", EMBED).status_code == 401  # the hot route's own check
    assert keyed.get("/v2/models/fake").status_code == 401
    assert keyed.get("/v1/nothing-here").status_code == 401
    assert keyed.get("/v1/models", OTHER).status_code == 401
    assert keyed.post("/v2/models/fake/infer", INFER, OTHER).status_code == 401
    assert keyed.get("/v1/models", KEY).status_code == 200
    assert refusals("missing_key") == 3 and refusals("invalid_key") == 2


def test_without_a_keys_file_everything_is_open(tmp_path: Path) -> None:
    with running(_config(tmp_path, keys=None)) as server:
        assert server.post("/v1/embeddings", EMBED).status_code == 200
        assert server.get("/v2/models/fake").status_code == 200


def test_a_missing_or_empty_keys_file_stops_the_server_at_start_up(tmp_path: Path) -> None:
    missing = _config(tmp_path, keys=None, api_keys_file=str(tmp_path / "absent"))
    with pytest.raises(KeyFileError, match="cannot read"):
        create_app(_frontend(missing, tmp_path))
    empty = _config(tmp_path, keys="# only a comment\n\n")
    with pytest.raises(KeyFileError, match="holds no key"):
        create_app(_frontend(empty, tmp_path))


# -- rotation without a restart -------------------------------------------------------------------------


def _serves(server: Server, key: str) -> bool:
    return server.post("/v1/embeddings", EMBED, key).status_code == 200


def test_keys_reload_when_the_file_is_rewritten(tmp_path: Path) -> None:
    with running(_config(tmp_path, keys=f"# team a\n{KEY}\n")) as server:
        assert _serves(server, KEY) and not _serves(server, OTHER)
        # Rotation step 1: both keys, written in place.
        (tmp_path / "keys").write_text(f"{KEY}\n{OTHER}\n")
        wait_for(lambda: _serves(server, OTHER), 10, "the added key to be accepted")
        assert _serves(server, KEY)
        # Step 2: the old key removed, by replacing the file (mv over it).
        (tmp_path / "keys.new").write_text(f"{OTHER}\n")
        os.replace(tmp_path / "keys.new", tmp_path / "keys")
        wait_for(lambda: not _serves(server, KEY), 10, "the removed key to be refused")
        assert _serves(server, OTHER)


def _secret_volume(root: Path, version: str, keys: str) -> None:
    """Lay out or update a Secret volume as the kubelet does: `keys -> ..data/keys`, `..data -> <dir>`,
    updated by writing a new folder and renaming a new `..data` symlink over the old one."""
    folder = root / f"..{version}"
    folder.mkdir()
    (folder / "keys").write_text(keys)
    (root / "..data_tmp").symlink_to(folder.name)
    os.replace(root / "..data_tmp", root / "..data")
    if not (root / "keys").is_symlink():
        (root / "keys").symlink_to("..data/keys")


def test_keys_reload_when_a_secret_volume_swaps_its_symlink(tmp_path: Path) -> None:
    volume = tmp_path / "secret"
    volume.mkdir()
    _secret_volume(volume, "2026_01_01_v1", f"{KEY}\n")
    config = _config(tmp_path, keys=None, api_keys_file=str(volume / "keys"))
    with running(config) as server:
        assert _serves(server, KEY) and not _serves(server, OTHER)
        _secret_volume(volume, "2026_01_02_v2", f"{OTHER}\n")
        wait_for(lambda: _serves(server, OTHER), 10, "the new Secret's key to be accepted")
        assert not _serves(server, KEY)


# -- clients, unchanged ------------------------------------------------------------------------------


def test_the_openai_sdk_authenticates_with_its_api_key(keyed: Server) -> None:
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0)
    result = client.embeddings.create(model="fake", input=["a b"])
    assert result.data[0].embedding == pytest.approx(expected_embedding("a b"))
    assert [model.id for model in client.models.list()] == ["fake"]
    wrong = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=OTHER, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        wrong.embeddings.create(model="fake", input=["a b"])


def test_tritonclient_authenticates_with_a_header(keyed: Server) -> None:
    client = triton.InferenceServerClient(url=keyed.url.removeprefix("http://"))
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        assert client.is_server_live() and client.is_server_ready()  # health: no key needed
        assert client.is_model_ready("fake", headers=headers)
        assert client.get_model_metadata("fake", headers=headers)["name"] == "fake"
        text = triton.InferInput("text", [1], "BYTES")
        # JSON tensors: carpool's v2 front does not take the binary tensor extension.
        text.set_data_from_numpy(np.array([b"a b"], dtype=np.object_), binary_data=False)
        wanted = [triton.InferRequestedOutput("embedding", binary_data=False)]
        result = client.infer("fake", [text], outputs=wanted, headers=headers)
        assert result.as_numpy("embedding").tolist() == [pytest.approx(expected_embedding("a b"))]
        with pytest.raises(InferenceServerException, match="missing API key"):
            client.infer("fake", [text], outputs=wanted)
    finally:
        client.close()


# -- metrics on a port of its own ------------------------------------------------------------------------


def test_metrics_port_serves_metrics_without_a_key_and_closes_the_api_ports_metrics(tmp_path: Path) -> None:
    port = _port()
    with running(_config(tmp_path, metrics_port=port)) as server:
        scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert scrape.status_code == 200 and 'carpool_ready{model="fake"} 1.0' in scrape.text
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 404
        assert server.get("/metrics").status_code == 401
        assert server.get("/metrics", KEY).status_code == 200
        assert server.get("/v2/health/ready").status_code == 200
    with pytest.raises(httpx.ConnectError):  # the listener stops with the app
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)


# -- HTTPS ------------------------------------------------------------------------------------------------


def _make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, made with the openssl command."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _make_certificate(tmp_path_factory.mktemp("tls"))


def test_https_serves_the_api_and_the_probes(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    config = _config(tmp_path, tls={"cert_file": str(cert), "key_file": str(key)})
    trust = ssl.create_default_context(cafile=str(cert))
    with running(config, verify=trust) as server:
        assert server.url.startswith("https://")
        assert server.post("/v1/embeddings", EMBED, KEY).status_code == 200
        assert server.post("/v1/embeddings", EMBED).status_code == 401
        # The kubelet's HTTPS probes do not verify the certificate; they must still get their answers.
        probe = httpx.Client(base_url=server.url, verify=False, timeout=10)
        assert probe.get("/v2/health/live").status_code == 200
        assert probe.get("/v2/health/ready").status_code == 200
        probe.close()
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port gets no answer
            httpx.get(server.url.replace("https://", "http://") + "/v2/health/live", timeout=10)


def _presented(url: str) -> str:
    host, port = url.removeprefix("https://").split(":")
    return ssl.get_server_certificate((host, int(port)), timeout=10).strip()


def tls_secret_volume(root: Path) -> tuple[Path, Path]:
    """A kubernetes.io/tls Secret volume at `root`: tls.crt -> ..data/tls.crt, ..data -> the current
    version (a certificate made now); returns the volume and that certificate."""
    root.mkdir()
    first = _make_certificate(root / "..v1")
    (root / "..data").symlink_to("..v1")
    for name in ("tls.crt", "tls.key"):
        (root / name).symlink_to(f"..data/{name}")
    return root, first[0]


def renew_certificate(volume: Path) -> Path:
    """What the kubelet does when cert-manager renews the Secret: a new version, swapped in at once."""
    renewed = _make_certificate(volume / "..v2")
    (volume / "..data_tmp").symlink_to("..v2")
    os.replace(volume / "..data_tmp", volume / "..data")
    return renewed[0]


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    volume, first = tls_secret_volume(tmp_path / "tls")
    config = _config(
        tmp_path, tls={"cert_file": str(volume / "tls.crt"), "key_file": str(volume / "tls.key")}
    )
    with running(config, verify=False) as server:
        assert _presented(server.url) == first.read_text().strip()
        renewed = renew_certificate(volume)
        wait_for(lambda: _presented(server.url) == renewed.read_text().strip(), 10, "the renewed certificate")
        assert server.get("/v2/health/ready").status_code == 200


def test_tls_maps_to_uvicorn_options(tmp_path: Path) -> None:
    plain = _config(tmp_path, keys=None)
    assert uvicorn_tls(plain.server) == {}
    mutual = _config(tmp_path, keys=None, tls={"cert_file": "/c", "key_file": "/k", "client_ca_file": "/ca"})
    assert uvicorn_tls(mutual.server) == {
        "ssl_certfile": "/c",
        "ssl_keyfile": "/k",
        "ssl_ca_certs": "/ca",
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
