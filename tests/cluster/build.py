"""Builds the cluster tier's control plane from its Go modules, into a cache outside the work tree.

`make cluster-bin` runs `python -m tests.cluster.build`; the fixture in tests/cluster/controlplane.py
only looks the binaries up (`locate`), so a test run never compiles. What is built, and from what:

- etcd, from `go.etcd.io/etcd/server/v3` (tests/cluster/bin/etcd/go.mod: the version k8s.io/kubernetes
  itself requires);
- prometheus-adapter's `adapter` from `sigs.k8s.io/prometheus-adapter`
  (tests/cluster/bin/prometheus-adapter/go.mod: its own module's requirements, k8s.io/* v0.30; it is a
  client and an aggregated server of the API server, so its libraries need not match the server's);
- Prometheus from `github.com/prometheus/prometheus` (tests/cluster/bin/prometheus/go.mod, v0.316.0 is
  Prometheus 3.16.0) with the build tags `remove_all_sd,enable_kubernetes_sd`: Debian's `prometheus`
  package (which the e2e tier runs) is built without `kubernetes_sd_configs`, which the autoscaling
  test needs to discover pods from the API server;
- the LeaderWorkerSet controller manager (`lws-manager`) from `sigs.k8s.io/lws` (tests/cluster/bin/lws/go.mod,
  its own module's requirements); the tier installs its CRD from the same module in the module cache
  (config/crd/bases) and serves its webhooks with the tier's PKI;
- the Gateway API Inference Extension's endpoint picker (`epp`) from
  `sigs.k8s.io/gateway-api-inference-extension` (tests/cluster/bin/epp/go.mod, its own module's
  requirements); the tier installs the InferencePool CRD from the same module (config/crd/bases) and plays
  the gateway's part against the EPP's ext_proc port;
- kube-apiserver, kube-controller-manager, kube-scheduler and kube-proxy from `k8s.io/kubernetes`
  (tests/cluster/bin/kubernetes/go.mod). That module requires its ~30 staging modules (k8s.io/api,
  apimachinery, client-go, ...) at v0.0.0 and points them at ./staging with `replace` directives a consumer
  does not inherit, so our go.mod pins each by a replace of its own at v0.<minor>.<patch>
  (kubernetes/kubernetes#79384 explains why the project does not support this use, and why it works).

Another Kubernetes version (`--k8s-version 1.29.15`, or `make cluster-bin K8S_VERSION=1.29.15`) gets a
go.mod generated into the cache from that release's own go.mod (its replace block lists the staging
modules), tidied through the Go module proxy, then built the same way.

The cache is `$CARPOOL_CLUSTER_CACHE`, else `$XDG_CACHE_HOME/carpool/cluster-bin`, else
`~/.cache/carpool/cluster-bin`: one folder per component, version and hash of its go.mod and go.sum
(`kubernetes-v1.35.4-1a2b3c4d/`), so a change of pins builds anew and an unchanged one is reused. A folder
is complete only once its `build.json` exists (written last, with the build's duration). Nothing is
downloaded but through the Go module proxy: no prebuilt binary from anywhere.

Stdlib only: `make cluster-bin` runs it before the virtual environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = HERE / "bin"

KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy")
ETCD_COMMAND = "etcd"
ADAPTER_COMMAND = "adapter"
PROMETHEUS_COMMAND = "prometheus"
LWS_COMMAND = "lws-manager"
EPP_COMMAND = "epp"


@dataclass(frozen=True)
class Component:
    """One Go module of ours that builds some commands."""

    name: str
    """Folder under tests/cluster/bin/ and prefix of the cache folder."""
    module: str
    """The upstream module whose version names the build (required in our go.mod)."""
    packages: tuple[str, ...]
    """Import paths of the main packages, built into commands named after their last element."""
    commands: tuple[str, ...]
    tags: tuple[str, ...] = ()
    """Go build tags."""


KUBERNETES = Component(
    "kubernetes",
    "k8s.io/kubernetes",
    tuple(f"k8s.io/kubernetes/cmd/{command}" for command in KUBERNETES_COMMANDS),
    KUBERNETES_COMMANDS,
)
ETCD = Component("etcd", "go.etcd.io/etcd/server/v3", ("go.etcd.io/etcd/server/v3",), (ETCD_COMMAND,))
PROMETHEUS_ADAPTER = Component(
    "prometheus-adapter",
    "sigs.k8s.io/prometheus-adapter",
    ("sigs.k8s.io/prometheus-adapter/cmd/adapter",),
    (ADAPTER_COMMAND,),
)
PROMETHEUS = Component(
    "prometheus",
    "github.com/prometheus/prometheus",
    ("github.com/prometheus/prometheus/cmd/prometheus",),
    (PROMETHEUS_COMMAND,),
    # Of the service discoveries, only Kubernetes' (plugins/plugin_kubernetes.go): a smaller build.
    ("remove_all_sd", "enable_kubernetes_sd"),
)
LWS = Component("lws", "sigs.k8s.io/lws", ("sigs.k8s.io/lws/cmd",), (LWS_COMMAND,))
"""The LeaderWorkerSet controller manager (its main package is `cmd`, so the command is named here)."""
EPP = Component(
    "epp",
    "sigs.k8s.io/gateway-api-inference-extension",
    ("sigs.k8s.io/gateway-api-inference-extension/cmd/epp",),
    (EPP_COMMAND,),
)
"""The endpoint picker the Gateway API Inference Extension's gateways call over Envoy's ext_proc."""


COMPONENTS = (ETCD, KUBERNETES, PROMETHEUS_ADAPTER, PROMETHEUS, LWS, EPP)
"""Every component, in the order a full build makes them."""


class BuildError(RuntimeError):
    pass


def cache_root() -> Path:
    explicit = os.environ.get("CARPOOL_CLUSTER_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "carpool" / "cluster-bin"


def pinned_version(component: Component) -> str:
    """The version our committed go.mod requires (`v1.35.4`)."""
    text = (MODULES / component.name / "go.mod").read_text()
    match = re.search(rf"^require {re.escape(component.module)} (v\S+)$", text, re.MULTILINE)
    if match is None:
        raise BuildError(f"{MODULES / component.name / 'go.mod'} does not require {component.module}")
    return match.group(1)


def _normalise(version: str) -> str:
    return version if version.startswith("v") else f"v{version}"


def ldflags(component: Component, version: str) -> str:
    """What Kubernetes' own build (hack/lib/version.sh) stamps into its binaries: without it they say
    v0.0.0-master, and Helm refuses a chart's `kubeVersion` against them."""
    if component is not KUBERNETES:
        return "-s -w"
    major, minor = version.removeprefix("v").split(".")[:2]
    stamps = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "gitCommit": f"module-{version}",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    flags = [
        f"-X {package}.{key}={value}"
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for key, value in stamps.items()
    ]
    return " ".join(["-s", "-w", *flags])


def _go(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-trimpath -mod=mod", "GOWORK": "off"}
    done = subprocess.run(["go", *args], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BuildError(f"go {' '.join(args)} (in {cwd}) failed:\n{done.stderr[-4000:]}")
    return done.stdout


def _staging_replaces(version: str, scratch: Path) -> list[str]:
    """The `replace` lines pinning each staging module of k8s.io/kubernetes `version` (v1.X.Y) at v0.X.Y."""
    info = json.loads(_go(["mod", "download", "-json", f"k8s.io/kubernetes@{version}"], scratch))
    upstream = Path(info["GoMod"]).read_text()
    staging = re.findall(r"^\s*(k8s\.io/[\w.-]+) => \./staging/", upstream, re.MULTILINE)
    if not staging:
        raise BuildError(f"k8s.io/kubernetes {version}'s go.mod names no staging modules")
    minor_patch = version.removeprefix("v1.")
    return [f"\t{module} => {module} v0.{minor_patch}" for module in staging]


def _source(component: Component, version: str) -> Path:
    """Where our module for `version` lives: committed, or generated into the cache (maybe not yet)."""
    if version == pinned_version(component):
        return MODULES / component.name
    return cache_root() / "src" / f"{component.name}-{version}"


def module_dir(component: Component, version: str) -> Path:
    """Our module for `version`: the committed one, or one generated into the cache for another version."""
    committed = MODULES / component.name
    generated = _source(component, version)
    if (generated / "go.sum").is_file():
        return generated
    generated.mkdir(parents=True, exist_ok=True)
    head = (committed / "go.mod").read_text().split("\nrequire ")[0]
    lines = [head.rstrip("\n"), "", f"require {component.module} {version}", ""]
    if component is KUBERNETES:
        lines += ["replace (", *_staging_replaces(version, generated), ")", ""]
    (generated / "go.mod").write_text("\n".join(lines))
    shutil.copy(committed / "tools.go", generated / "tools.go")
    _go(["mod", "tidy"], generated)
    return generated


def _fingerprint(component: Component, version: str, source: Path) -> str:
    digest = hashlib.sha256(ldflags(component, version).encode())
    digest.update(",".join(component.tags).encode())
    for name in ("go.mod", "go.sum"):
        digest.update((source / name).read_bytes())
    digest.update(sys.platform.encode())
    return digest.hexdigest()[:8]


def target_dir(component: Component, version: str, source: Path) -> Path:
    return cache_root() / f"{component.name}-{version}-{_fingerprint(component, version, source)}"


def locate(component: Component, version: str | None = None) -> Path | None:
    """The cache folder holding `component`'s commands at `version` (default: the pinned one), or None
    when it has not been built (an interrupted build has no build.json and does not count)."""
    version = _normalise(version) if version else pinned_version(component)
    source = _source(component, version)
    if not (source / "go.sum").is_file():
        return None
    folder = target_dir(component, version, source)
    return folder if (folder / "build.json").is_file() else None


def build(component: Component, version: str | None = None) -> Path:
    """Build (or find in the cache) `component`'s commands; returns their folder."""
    version = _normalise(version) if version else pinned_version(component)
    found = locate(component, version)
    if found is not None:
        return found
    source = module_dir(component, version)
    folder = target_dir(component, version, source)
    folder.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}-") as scratch:
        for package, command in zip(component.packages, component.commands, strict=True):
            output = str(Path(scratch) / command)
            tags = ["-tags", ",".join(component.tags)] if component.tags else []
            _go(["build", *tags, "-ldflags", ldflags(component, version), "-o", output, package], source)
        seconds = round(time.monotonic() - started, 1)
        facts = {"module": component.module, "version": version, "build_seconds": seconds}
        if folder.exists():
            shutil.rmtree(folder)
        Path(scratch).rename(folder)
    (folder / "build.json").write_text(json.dumps(facts) + "\n")
    return folder


def upstream_dir(component: Component, version: str | None = None) -> Path:
    """The upstream module's source in the Go module cache (downloaded through the proxy if absent): where
    the tier reads what a module ships beside its commands (the LeaderWorkerSet CRD and webhooks)."""
    version = _normalise(version) if version else pinned_version(component)
    listed = json.loads(
        _go(["mod", "download", "-json", f"{component.module}@{version}"], MODULES / component.name)
    )
    return Path(listed["Dir"])


def kubernetes_etcd_version(k8s_version: str) -> str:
    """The etcd server version a Kubernetes release requires (its go.mod), for a non-default release."""
    source = module_dir(KUBERNETES, k8s_version)
    listed = json.loads(_go(["list", "-m", "-json", "go.etcd.io/etcd/server/v3"], source))
    return str(listed["Version"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k8s-version", default=os.environ.get("K8S_VERSION") or None)
    parser.add_argument(
        "--only",
        action="append",
        choices=[c.name for c in COMPONENTS],
        help="build just this component (repeatable); default: all of them",
    )
    args = parser.parse_args(argv)
    k8s = _normalise(args.k8s_version) if args.k8s_version else pinned_version(KUBERNETES)
    versions = {c.name: pinned_version(c) for c in COMPONENTS}
    versions[KUBERNETES.name] = k8s
    if ETCD.name in (args.only or [ETCD.name]) and k8s != pinned_version(KUBERNETES):
        versions[ETCD.name] = kubernetes_etcd_version(k8s)
    for component in COMPONENTS:
        if args.only and component.name not in args.only:
            continue
        version = versions[component.name]
        cached = locate(component, version)
        started = time.monotonic()
        folder = build(component, version)
        took = json.loads((folder / "build.json").read_text())["build_seconds"]
        how = f"cached (built in {took} s)" if cached else f"built in {time.monotonic() - started:.0f} s"
        print(f"{component.module} {version}: {folder} [{how}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
