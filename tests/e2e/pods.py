"""What the operator would create for a BatchedModel, run for real as local processes.

No API server or kubelet runs on the test machines, so this module plays their parts as literally as it
can: the children come from the operator's own builders (`build_children`), a "pod" is the runtime
container's exact command, arguments and environment started as a process with the rendered ConfigMap
written to disk, and a `Kubelet` thread per pod runs the rendered startup, readiness and liveness probes
with their own paths, ports, periods, timeouts and thresholds.

What a local process cannot have, and what stands in for it (the only substitutions):
- volume mounts: each mount path is a folder of the pod's own temporary directory (the `config` volume
  holds the ConfigMap's items, a Secret volume the items of the Secret the test hands the pod, written
  with the volume's mode), and every environment value, and every string in the mounted runtime config,
  that starts with a mount path is rewritten to point there. So `CARPOOL_CONFIG=/etc/carpool/runtime.yaml`
  becomes `<pod>/etc/carpool/runtime.yaml`, and the config's `/etc/carpool/tls/tls.crt` the Secret's
  file. A PersistentVolumeClaim the test maps to a folder (`claims`) is that folder, shared by every pod
  that names the claim, as a volume outlives its pods; any other volume is the pod's own;
- the pod network: each pod has its own IP in a cluster, so all of them listen on container port 8000;
  here they share one host, so each pod gets `CARPOOL_SERVER__HOST=127.0.0.1` and
  `CARPOOL_SERVER__PORT=<a free port>` (the runtime's own environment settings, which override the
  mounted file), likewise its gRPC and its /metrics port (`*_GRPC_PORT`, `*_METRICS_PORT`); probes and
  Service ports that name a container port go to the pod's local port of that name;
- init containers (the `fetch` step that puts the model into the cache): run one after another to
  completion, with their own command and environment, before the runtime container starts, as the
  kubelet does; a non-zero exit fails the pod start with the init container's log;
- the image: its `ENV` lines (Dockerfile target `runtime`) come first, with this virtual environment's
  `bin/` in place of `/opt/carpool/bin` on PATH, so `carpool` resolves to the installed entry point.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from bench.server import children, free_port

from carpool.operator.resources import Children, build_children

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
EXAMPLE = ROOT / "examples" / "embedding-hpa.yaml"
PROBE_MARK = "e2e-kubelet:"
"""Prefix of the lines the kubelet stand-in appends to a pod's log, so that one file orders its events
and the runtime's (both write with O_APPEND)."""


def cpu_body(max_queue_size: int = 64, target_queue_depth: int = 8) -> dict[str, Any]:
    """examples/embedding-hpa.yaml (the packaged MiniLM embedding model, HPA on queue depth) made to run
    on a machine without a GPU: no GPU limit, node selector, tolerations or runtime class; the example's
    dtype dropped, so `auto` picks (bfloat16 on CPUs with native bf16, else float32); one CPU per pod (so
    one torch thread, as the operator derives from the limit); batches of 16 and a short queue, so that a
    closed loop of a few dozen clients saturates it and overload meets 429 quickly; a queue-depth target
    that this queue can exceed."""
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec = body["spec"]
    for key in ("nodeSelector", "tolerations", "runtimeClassName"):
        spec.pop(key, None)
    spec["model"].pop("dtype", None)
    spec["resources"] = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}
    spec["batching"].update(
        {"maxBatchSize": 16, "preferredBatchSizes": [8, 16], "maxQueueSize": max_queue_size}
    )
    spec["warmup"] = {"batchSizes": [1, 16]}
    # A model cache, so the pods run the `carpool fetch` init container before the runtime (the claim
    # is a folder of the pod here), and the runtime starts offline from what it fetched.
    spec["model"]["cache"] = {"claimName": "models"}
    spec["autoscaling"]["targetQueueDepth"] = target_queue_depth
    body["metadata"]["uid"] = "e2e-uid"
    return body


def render(body: dict[str, Any]) -> Children:
    return build_children(copy.deepcopy(body))


@dataclass(frozen=True)
class Probe:
    """An HTTP probe as the Pod spec declares it (defaults as in the Kubernetes API)."""

    path: str
    port: int | str
    period_s: float = 10.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1
    initial_delay_s: float = 0.0
    scheme: str = "HTTP"
    """`HTTPS` under TLS: the kubelet then does not verify the certificate."""

    @classmethod
    def of(cls, probe: dict[str, Any]) -> Probe:
        http = probe["httpGet"]
        return cls(
            path=http["path"],
            port=http["port"],
            scheme=http.get("scheme", "HTTP"),
            period_s=float(probe.get("periodSeconds", 10)),
            timeout_s=float(probe.get("timeoutSeconds", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
            success_threshold=int(probe.get("successThreshold", 1)),
            initial_delay_s=float(probe.get("initialDelaySeconds", 0)),
        )

    @property
    def budget_s(self) -> float:
        """How long the kubelet lets this probe fail before acting (restart, or not ready)."""
        return self.initial_delay_s + self.period_s * self.failure_threshold


@dataclass(frozen=True)
class PodTemplate:
    """The parts of the rendered Deployment and ConfigMap that a local pod runs."""

    name: str
    namespace: str
    labels: dict[str, str]
    container: dict[str, Any]
    init_containers: list[dict[str, Any]]
    volumes: list[dict[str, Any]]
    config_maps: dict[str, dict[str, str]]
    termination_grace_s: int

    @classmethod
    def of(cls, children: Children, namespace: str) -> PodTemplate:
        deployment = children.find("Deployment")
        assert deployment is not None
        config_maps = {
            m["metadata"]["name"]: m["data"] for m in children.manifests if m["kind"] == "ConfigMap"
        }
        pod = deployment["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        return cls(
            name=deployment["metadata"]["name"],
            namespace=namespace,
            labels=dict(pod["metadata"]["labels"]),
            container=container,
            init_containers=list(pod["spec"].get("initContainers") or []),
            volumes=pod["spec"]["volumes"],
            config_maps=config_maps,
            termination_grace_s=int(pod["spec"]["terminationGracePeriodSeconds"]),
        )

    @property
    def serving_port_name(self) -> str:
        """`https` under TLS, else `http`."""
        return "https" if self.has_port("https") else "http"

    def has_port(self, name: str) -> bool:
        return any(port["name"] == name for port in self.container["ports"])

    def port(self, name_or_number: int | str) -> int:
        """A probe's or Service's port, resolved against the container's named ports."""
        if isinstance(name_or_number, int):
            return name_or_number
        for port in self.container["ports"]:
            if port["name"] == name_or_number:
                return int(port["containerPort"])
        raise AssertionError(f"container has no port named {name_or_number!r}")

    def probe(self, kind: str) -> Probe:
        return Probe.of(self.container[kind])

    @property
    def pre_stop_sleep_s(self) -> float:
        command = self.container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", command
        return float(command[1])


def expand(value: str, defined: dict[str, str]) -> str:
    """A container's env value, command or argument with `$(NAME)` references expanded as the kubelet
    does (k8s.io/kubernetes third_party/forked/golang/expansion): a defined NAME is replaced, an undefined
    one left as written, `$$` is one `$`, any other `$` stays."""
    out: list[str] = []
    cursor = 0
    while cursor < len(value):
        char = value[cursor]
        if char != "$" or cursor + 1 == len(value):
            out.append(char)
            cursor += 1
            continue
        following = value[cursor + 1]
        if following == "$":
            out.append("$")
            cursor += 2
        elif following == "(":
            end = value.find(")", cursor + 2)
            if end == -1:  # an incomplete reference stays as written
                out.append("$(")
                cursor += 2
                continue
            name = value[cursor + 2 : end]
            out.append(defined.get(name, f"$({name})"))
            cursor = end + 1
        else:
            out.append(char + following)
            cursor += 2
    return "".join(out)


def _image_env(venv_bin: Path) -> dict[str, str]:
    # The Dockerfile's `runtime` target: ENV PATH=/opt/carpool/bin:$PATH, PYTHONDONTWRITEBYTECODE=1,
    # PYTHONUNBUFFERED=1, HOME=/home/carpool, HF_HOME=/var/cache/carpool/huggingface.
    env = {
        "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "HOME": "/home/carpool",
        "HF_HOME": "/var/cache/carpool/huggingface",
    }
    # The source under test, as the image carries its own: a checkout whose tests run with its source
    # first on PYTHONPATH (a git worktree beside an environment installed from another) runs that source
    # in its pods too, not the environment's.
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


class LocalPod:
    """One replica: the rendered container as a process on a loopback port."""

    def __init__(
        self,
        template: PodTemplate,
        name: str,
        workdir: Path,
        address: str | None = None,
        secrets: dict[str, dict[str, str]] | None = None,
        claims: dict[str, Path] | None = None,
    ) -> None:
        """`address`: the pod's own IP (tests/cluster's kubelet stand-in), where the runtime binds the
        container's own ports; without one, it binds 127.0.0.1 on free ports (see the module docstring).
        `secrets`: the Secrets the pod's volumes may name (name -> data; None: each Secret volume is an
        empty folder, as tests/cluster's kubelet stand-in has it); `claims`: PersistentVolumeClaims by
        name -> the folder that stands for the volume."""
        self.template = template
        self.name = name
        self.dir = workdir / name
        self.host = address or HOST
        self.own_address = address is not None
        self.port = template.port(template.serving_port_name) if address else free_port()
        self.grpc_port = free_port()
        self.metrics_port = free_port()
        self.scheme = "https" if template.serving_port_name == "https" else "http"
        self.log_path = self.dir / "container.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.secrets = secrets
        self.claims = claims or {}
        self.mounts = self._mount_paths()
        self._fill_volumes()
        self.command, self.env = self._command_and_env(template.container)
        self.init_commands = [
            (init["name"], *self._command_and_env(init)) for init in template.init_containers
        ]

    def _mounts(self) -> list[dict[str, Any]]:
        containers = [*self.template.init_containers, self.template.container]
        return [m for c in containers for m in c.get("volumeMounts", [])]

    def _mount_paths(self) -> dict[str, Path]:
        volumes = {v["name"]: v for v in self.template.volumes}
        mounts: dict[str, Path] = {}
        for mount in self._mounts():
            claim = volumes[mount["name"]].get("persistentVolumeClaim", {}).get("claimName")
            local = self.claims[claim] if claim in self.claims else self.dir / mount["mountPath"].lstrip("/")
            local.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = local
        return mounts

    def _fill_volumes(self) -> None:
        """The ConfigMap's and Secrets' items into their mounts' folders (once: init containers and the
        runtime container mount the same volume)."""
        volumes = {v["name"]: v for v in self.template.volumes}
        filled: set[str] = set()
        for mount in self._mounts():
            volume, local = volumes[mount["name"]], self.mounts[mount["mountPath"]]
            if volume["name"] in filled:
                continue
            filled.add(volume["name"])
            if "configMap" in volume:
                data = self.template.config_maps[volume["configMap"]["name"]]
                for item in volume["configMap"].get("items") or [{"key": k, "path": k} for k in data]:
                    (local / item["path"]).write_text(self._translate_config(data[item["key"]]))
            elif "secret" in volume and self.secrets is not None:
                name = volume["secret"]["secretName"]
                assert name in self.secrets, f"the pod mounts Secret {name!r}, which the test did not create"
                data = self.secrets[name]
                mode = int(volume["secret"].get("defaultMode", 0o644))
                for item in volume["secret"].get("items") or [{"key": k, "path": k} for k in data]:
                    path = local / item["path"]
                    path.write_text(data[item["key"]])
                    path.chmod(mode)

    def _translate_config(self, text: str) -> str:
        """The runtime config with every path inside a mount pointing at the mount's local folder."""

        def walk(value: Any) -> Any:
            if isinstance(value, dict):
                return {key: walk(item) for key, item in value.items()}
            if isinstance(value, list):
                return [walk(item) for item in value]
            return self._translate(value) if isinstance(value, str) else value

        data = yaml.safe_load(text)
        translated = walk(data)
        return text if translated == data else yaml.safe_dump(translated, sort_keys=True)

    def _translate(self, value: str) -> str:
        for mount_path in sorted(self.mounts, key=len, reverse=True):
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(self.mounts[mount_path]) + value[len(mount_path.rstrip("/")) :]
        return value

    def _command_and_env(self, container: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        env = _image_env(Path(sys.executable).parent)
        defined: dict[str, str] = {}
        for var in container.get("env", []):
            assert "value" in var, f"e2e pods take only literal env values, got {var}"
            # The kubelet expands $(NAME) from the variables listed before this one.
            defined[var["name"]] = expand(var["value"], defined)
            env[var["name"]] = defined[var["name"]]
        # PATH names this machine's folders already (the virtual environment may live under /tmp).
        env = {key: value if key == "PATH" else self._translate(value) for key, value in env.items()}
        # The pod network, locally: one host, so one port per pod (see the module docstring).
        env["CARPOOL_SERVER__HOST"] = self.host
        if not self.own_address:
            env["CARPOOL_SERVER__PORT"] = str(self.port)
            env["CARPOOL_SERVER__GRPC_PORT"] = str(self.grpc_port)
            if self.template.has_port("metrics"):
                env["CARPOOL_SERVER__METRICS_PORT"] = str(self.metrics_port)
        written = [*container.get("command", []), *container.get("args", [])]
        command = [expand(part, defined) for part in written]
        resolved = shutil.which(command[0], path=env["PATH"])
        assert resolved is not None, f"{command[0]} is not on the pod's PATH {env['PATH']}"
        return [resolved, *command[1:]], env

    @property
    def config_path(self) -> Path:
        return Path(self.env["CARPOOL_CONFIG"])

    INIT_TIMEOUT_S = 300.0

    def run_init_containers(self) -> None:
        """Each init container to completion, in order; the runtime starts only after all succeed."""
        for name, command, env in self.init_commands:
            log = self.dir / f"init-{name}.log"
            with log.open("ab") as out:
                done = subprocess.run(
                    command,
                    env=env,
                    cwd=self.dir,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=self.INIT_TIMEOUT_S,
                    check=False,
                )
            assert done.returncode == 0, f"init container {name} exited {done.returncode}:\n{log.read_text()}"

    def start(self) -> None:
        self.run_init_containers()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.started_at = time.monotonic()
            # Its own process group, which is then the container: everything the runtime starts (its
            # fronts, engine, vLLM's rank processes) and nothing else, for `kill_container`. Not its own
            # session: with the kernel's autogroup scheduling each session gets an equal share of the
            # CPU, and two pods pinned to one core (vLLM's ranks) then ran steps 20x slower.
            self.proc = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=self.dir,
                stdout=fd,
                stderr=fd,
                stdin=subprocess.DEVNULL,
                process_group=0,
            )
        finally:
            os.close(fd)

    def kill_container(self) -> None:
        """SIGKILL every process of the container, as a container runtime ends a container (its cgroup)
        when its main process exits or its grace period runs out: the pod's process group, which its main
        process leads, so a child that outlives it (a rank process vLLM spawned) goes too."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def url(self, path: str = "") -> str:
        return f"{self.scheme}://{self.host}:{self.port}{path}"

    def local_port(self, container_port: int) -> int:
        """Where this pod serves one of its container's ports (see the module docstring)."""
        if self.own_address:
            return container_port
        by_name = {"http": self.port, "https": self.port, "grpc": self.grpc_port}
        by_name["metrics"] = self.metrics_port
        for port in self.template.container["ports"]:
            if port["containerPort"] == container_port:
                return by_name[port["name"]]
        raise AssertionError(f"container has no port {container_port}")

    def through_service(self, service: dict[str, Any], port_name: str) -> int:
        """The local port that the Service's port `port_name` reaches on this pod: the Service must select
        the pod's labels, and its `targetPort` must name (or number) one of the container's ports."""
        selector = service["spec"]["selector"]
        labels = self.template.labels
        assert all(labels.get(k) == v for k, v in selector.items()), f"{selector} does not select {labels}"
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == port_name]
        return self.local_port(self.template.port(port["targetPort"]))

    def probe_url(self, probe: Probe) -> str:
        """Where the kubelet would send `probe`: its port (a name resolves against the container's ports)
        is the runtime's container port, which this pod serves on its own local port, in the probe's
        scheme."""
        container_port = self.template.port(probe.port)
        served = yaml.safe_load(self.config_path.read_text())["server"]["port"]
        assert container_port == served, f"probe port {container_port} is not the runtime's port {served}"
        return f"{probe.scheme.lower()}://{self.host}:{self.port}{probe.path}"

    def mark(self, text: str) -> None:
        """Append a line to the container log; O_APPEND orders it after everything the runtime wrote."""
        with self.log_path.open("a") as log:
            log.write(f"{PROBE_MARK} {text}\n")

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def messages(self) -> list[str]:
        """The runtime's log messages (JSON lines) and the kubelet marks, in file order."""
        found = []
        for line in self.log_lines():
            if line.startswith(PROBE_MARK):
                found.append(line)
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and "message" in entry:
                found.append(str(entry["message"]))
        return found

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_lines()[-lines:])

    def rss_bytes(self) -> int:
        """Resident set size now (VmRSS), 0 once the process is gone."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def sigterm(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def engine_pid(self) -> int:
        """The runtime's engine process: the supervisor's child whose main thread the engine names
        `carpool-engine` (`carpool.runtime.threads`; the fronts, Python and native, are `carpool-front`)."""
        spawned: dict[int, str] = {}
        for pid in children(self.pid):
            with contextlib.suppress(OSError):
                spawned[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
        engines = [pid for pid, name in spawned.items() if name == "carpool-engine"]
        assert len(engines) == 1, f"expected one engine process among {spawned}, found {engines}"
        return engines[0]

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM to the main process and wait; SIGKILL (and None) if it does not exit in time. Then
        whatever else of the container still runs is killed (`kill_container`)."""
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is not None:
                return self.proc.returncode
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return None
        finally:
            self.kill_container()


@dataclass(frozen=True)
class ProbeResult:
    at: float
    """time.monotonic() when the answer (or the failure) came."""
    status: int | None
    """HTTP status, or None for a connection error or a timeout."""

    @property
    def ok(self) -> bool:
        # The kubelet's rule for httpGet probes: 200 <= status < 400 succeeds.
        return self.status is not None and 200 <= self.status < 400


@dataclass
class Kubelet:
    """The kubelet's probe loop for one pod: the startup probe until it succeeds (or its budget is gone),
    then readiness and liveness, each on its own period. `on_readiness` runs after every readiness probe
    (the test scrapes /metrics there); the first success is marked in the pod's log."""

    pod: LocalPod
    on_readiness: Callable[[ProbeResult], None] | None = None
    startup: list[ProbeResult] = field(default_factory=list)
    readiness: list[ProbeResult] = field(default_factory=list)
    liveness: list[ProbeResult] = field(default_factory=list)
    started_ok_at: float | None = None
    ready_at: float | None = None
    startup_failed: bool = False
    restart_needed: bool = False
    """Liveness failed failureThreshold times in a row: the kubelet would have restarted the container."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ready_now = False
        self._client = httpx.Client(trust_env=False, verify=False)  # the kubelet verifies no certificate

    def _get(self, probe: Probe) -> ProbeResult:
        try:
            status: int | None = self._client.get(
                self.pod.probe_url(probe), timeout=probe.timeout_s
            ).status_code
        except httpx.HTTPError:
            status = None
        return ProbeResult(time.monotonic(), status)

    def _periodic(self, probe: Probe, tick: Callable[[], bool]) -> None:
        """Run `tick` every period (from the probe's start, like the kubelet's ticker) until it says stop."""
        next_at = time.monotonic() + probe.initial_delay_s
        while not self._stop.is_set():
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                return
            next_at += probe.period_s
            if not tick():
                return

    def start(self) -> None:
        thread = threading.Thread(target=self._run, name=f"kubelet-{self.pod.name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self) -> None:
        template = self.pod.template
        startup = template.probe("startupProbe")
        failures = 0

        def startup_tick() -> bool:
            nonlocal failures
            result = self._get(startup)
            self.startup.append(result)
            if result.ok:
                self.started_ok_at = result.at
                return False
            failures += 1
            if failures >= startup.failure_threshold:
                self.startup_failed = True
                return False
            return True

        self._periodic(startup, startup_tick)
        if self.started_ok_at is None:
            return
        readiness_thread = threading.Thread(target=self._readiness, daemon=True)
        liveness_thread = threading.Thread(target=self._liveness, daemon=True)
        self._threads += [readiness_thread, liveness_thread]
        readiness_thread.start()
        liveness_thread.start()

    def _readiness(self) -> None:
        probe = self.pod.template.probe("readinessProbe")
        successes = failures = 0

        def tick() -> bool:
            nonlocal successes, failures
            result = self._get(probe)
            if result.ok and self.ready_at is None:
                self.pod.mark(f"readiness probe {probe.path} answered {result.status}")
            self.readiness.append(result)
            if self.on_readiness is not None:
                self.on_readiness(result)
            if result.ok:
                successes, failures = successes + 1, 0
                if successes >= probe.success_threshold:
                    self.ready_now = True
                    if self.ready_at is None:
                        self.ready_at = result.at
            else:
                successes, failures = 0, failures + 1
                if failures >= probe.failure_threshold:
                    self.ready_now = False
            return True

        self._periodic(probe, tick)

    def _liveness(self) -> None:
        probe = self.pod.template.probe("livenessProbe")
        failures = 0

        def tick() -> bool:
            nonlocal failures
            result = self._get(probe)
            self.liveness.append(result)
            failures = 0 if result.ok else failures + 1
            if failures >= probe.failure_threshold and self.pod.proc and self.pod.proc.poll() is None:
                self.restart_needed = True
            return True

        self._periodic(probe, tick)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._client.close()


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Poll `condition` until it holds; fail after `timeout_s` (a deadline, never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def first_index(lines: list[str], predicate: Callable[[str], bool]) -> int | None:
    return next((i for i, line in enumerate(lines) if predicate(line)), None)
