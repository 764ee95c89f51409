"""The `carpool` command. Subcommands import what they need only when they run, so `--help` is fast
and the operator image (no torch) can use the same entry point."""

from __future__ import annotations

import argparse
import enum
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError
from pydantic_settings import CliSettingsSource

from carpool.runtime.config import ConfigError, RuntimeConfig, load_config


class _CliSource(CliSettingsSource[RuntimeConfig]):
    """pydantic-settings' CLI source, with enum choices and defaults in `--help` as users write them
    (`{embed,classify,generate}`, `(default: embed)`: the values the config takes) instead of the Python
    member names (`{EMBED,CLASSIFY,GENERATE}`), which the YAML file and the CRD never use."""

    def _metavar_format_recurse(self, obj: Any) -> str:
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            return "{" + ",".join(str(member.value) for member in obj) + "}"
        return str(super()._metavar_format_recurse(obj))

    def _help_format(self, field_name: str, field_info: Any, *args: Any, **kwargs: Any) -> str:
        text = str(super()._help_format(field_name, field_info, *args, **kwargs))
        default = field_info.default
        if isinstance(default, enum.Enum):
            text = text.replace(f"(default: {default.name})", f"(default: {default.value})")
        return text


def _config_parser(parser: argparse.ArgumentParser) -> CliSettingsSource[RuntimeConfig]:
    parser.add_argument(
        "--config",
        "-c",
        type=Path,
        default=None,
        help="YAML file with runtime settings (also CARPOOL_CONFIG; default /etc/carpool/runtime.yaml "
        "when it exists). Flags override environment variables, which override the file.",
    )
    return _CliSource(
        RuntimeConfig,
        root_parser=parser,
        cli_kebab_case=True,
        cli_implicit_flags=False,
        cli_prog_name=parser.prog,
    )


def _resolve(args: argparse.Namespace, source: CliSettingsSource[RuntimeConfig]) -> RuntimeConfig:
    overrides = source(parsed_args=args)()  # the nested values the flags set
    try:
        return load_config(args.config, **overrides)
    except (ValidationError, ConfigError) as exc:
        raise SystemExit(f"carpool: invalid configuration:\n{_explain(exc)}") from None


def _explain(exc: ValidationError | ConfigError) -> str:
    if isinstance(exc, ConfigError):
        return f"  {exc}"
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "config"
        lines.append(f"  {where}: {error['msg']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="carpool", description="Dynamic-batching model serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the model server",
        description="Serve a model over HTTP with dynamic batching (OpenAI and KServe v2 APIs, /metrics).",
    )
    serve_source = _config_parser(serve)

    fetch = commands.add_parser(
        "fetch",
        help="download or locate the model into the cache and verify it (the pods' init container)",
        description="Put model.source into the model cache (HF_HOME) and verify the files, so that "
        "`carpool serve` starts without downloading.",
    )
    fetch.add_argument(
        "--convert-gguf",
        action="store_true",
        help="also convert a GGUF source to the safetensors folder vLLM serves on CPU, into the cache "
        "(the operator adds it for pods on vLLM's engine without a GPU)",
    )
    fetch_source = _config_parser(fetch)

    show = commands.add_parser(
        "config",
        help="print the effective runtime configuration as YAML",
        description="Resolve defaults, the YAML file, CARPOOL_* variables and flags; print the result.",
    )
    show_source = _config_parser(show)

    _add_operator_commands(commands)

    args = parser.parse_args(argv)
    if args.command in _OPERATOR_COMMANDS:
        return _OPERATOR_COMMANDS[args.command](args)
    if args.command == "fetch":
        return _fetch(_reported(lambda: _resolve(args, fetch_source)), args.convert_gguf)
    if args.command == "serve":
        config = _reported(lambda: _resolve(args, serve_source))
        from carpool.runtime.server import run

        return _reported(lambda: run(config))
    config = _resolve(args, show_source)
    sys.stdout.write(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return 0


T = TypeVar("T")


def _reported(step: Callable[[], T]) -> T:
    """Run a start-up step; a fatal error also goes to the termination log, where Kubernetes shows it."""
    from carpool.runtime.termination import write_termination_message

    try:
        return step()
    except SystemExit as exc:
        if isinstance(exc.code, str):
            write_termination_message(exc.code)
        raise
    except Exception as exc:
        write_termination_message(f"{type(exc).__name__}: {exc}")
        raise


def _fetch(config: RuntimeConfig, convert_gguf: bool = False) -> int:
    from carpool.runtime.fetch import FetchError, convert_for_vllm, fetch, fetch_adapter

    try:
        fetched = fetch(config.model)
        adapters = {name: fetch_adapter(name, source) for name, source in config.lora.adapters.items()}
        converted = convert_for_vllm(config.model) if convert_gguf else None
    except FetchError as exc:
        message = f"carpool fetch: {exc}"
        from carpool.runtime.termination import write_termination_message

        write_termination_message(message)
        sys.stderr.write(message + "\n")
        return 1
    sys.stdout.write(
        f"carpool fetch: {config.model.source} ready at {fetched.folder} "
        f"({fetched.weight_files} weight files, {fetched.weight_bytes / 1e6:.1f} MB)\n"
    )
    for name, folder in adapters.items():
        sys.stdout.write(f"carpool fetch: LoRA adapter {name} ready at {folder}\n")
    if converted is not None:
        sys.stdout.write(f"carpool fetch: converted for vLLM at {converted}\n")
    return 0


# --- operator subcommands: carpool.operator is imported only when one of them runs ----------------------


def _add_operator_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    operator = commands.add_parser(
        "operator",
        help="run the BatchedModel operator",
        description="Run the kopf operator that turns BatchedModels into autoscaled model services.",
    )
    operator.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        dest="namespaces",
        metavar="NS",
        help="serve only this namespace (repeatable, globs allowed); default: all namespaces",
    )
    operator.add_argument("--standalone", action="store_true", help="no peering (one replica only)")
    operator.add_argument(
        "--leader-elect",
        action="store_true",
        help="several replicas: only the holder of a coordination.k8s.io Lease works (as controller-runtime: "
        "see the --leader-elect-* timings); replaces kopf peering",
    )
    operator.add_argument(
        "--leader-election-namespace",
        default=None,
        help="namespace of the Lease (default: $POD_NAMESPACE, else the service account's namespace)",
    )
    operator.add_argument(
        "--leader-election-id",
        default="carpool-operator",
        help="name of the Lease (default carpool-operator)",
    )
    for flag, default, what in (
        (
            "--leader-elect-lease-duration",
            15,
            "how long a standby waits for an unrenewed lease (whole seconds)",
        ),
        ("--leader-elect-renew-deadline", 10, "how long the leader goes on without renewing before it exits"),
        ("--leader-elect-retry-period", 2, "between attempts to acquire or renew"),
    ):
        operator.add_argument(
            flag, type=float, default=float(default), metavar="SECONDS", help=f"{what} (default {default})"
        )
    operator.add_argument(
        "--peering", default="carpool", help="peering object name for several replicas (default carpool)"
    )
    operator.add_argument(
        "--priority",
        type=int,
        default=0,
        help="peering priority of this replica; the highest runs, the others wait. 0 (default): derived from "
        "POD_ID, distinct per pod and below any positive priority (a developer's operator wins)",
    )
    operator.add_argument(
        "--liveness-port", type=int, default=8080, help="port of /healthz (0 turns it off; default 8080)"
    )
    operator.add_argument(
        "--metrics-port", type=int, default=9090, help="port of /metrics (0 turns it off; default 9090)"
    )
    operator.add_argument(
        "--metrics-namespace",
        action="append",
        default=None,
        dest="metrics_namespaces",
        metavar="NS",
        help="namespace Prometheus scrapes from: the runtime pods' NetworkPolicy admits it to /metrics "
        "(repeatable; default monitoring; an empty value admits none)",
    )
    _runtime_image_argument(operator)
    operator.add_argument(
        "--slow-retry-period",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="seconds before a model is tried again after the API server refused one of its objects (403, "
        "5xx) or while an API it needs is missing (KEDA, LeaderWorkerSet, InferencePool); half of it after a "
        "name conflict (default 60)",
    )
    operator.add_argument("--log-format", choices=["json", "plain", "full"], default="json")
    operator.add_argument("--verbose", "-v", action="store_true", help="log more")
    operator.add_argument("--debug", action="store_true", help="log everything kopf does")

    commands.add_parser(
        "crd",
        help="print the BatchedModel CustomResourceDefinition",
        description="Print the CRD generated from the operator's spec model (crds/batchedmodel.yaml).",
    )

    render = commands.add_parser(
        "render",
        help="print the Kubernetes objects the operator would create for a BatchedModel",
        description="Render a BatchedModel file into the children the operator applies "
        "(pipe into `kubectl apply --dry-run=server -f -`).",
    )
    render.add_argument("--filename", "-f", required=True, help="BatchedModel YAML file, or - for stdin")
    render.add_argument("--namespace", "-n", default=None, help="namespace (default: the file's, or default)")
    render.add_argument(
        "--metrics-namespace",
        action="append",
        default=None,
        dest="metrics_namespaces",
        metavar="NS",
        help="as for `carpool operator`: where Prometheus scrapes from (default monitoring)",
    )
    _runtime_image_argument(render)


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not seconds > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, not {text}")
    return seconds


def _runtime_image_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime-image",
        default=None,
        metavar="IMAGE",
        help="the runtime image pods run unless their BatchedModel names one (repository:tag); pods that "
        "request no GPU run its tag plus -cpu, pods that run vLLM's engine its tag plus -vllm "
        "(default: this release's image)",
    )


def _run_operator(args: argparse.Namespace) -> int:
    import asyncio

    from carpool.operator.leader import Timing
    from carpool.operator.reconcile import SLOW_RETRY_SECONDS
    from carpool.operator.run import OperatorOptions, configure_logging, run_operator

    options = OperatorOptions(
        namespaces=args.namespaces,
        standalone=args.standalone,
        leader_election=args.leader_elect,
        leader_election_namespace=args.leader_election_namespace,
        leader_election_id=args.leader_election_id,
        leader_election_timing=Timing(
            args.leader_elect_lease_duration, args.leader_elect_renew_deadline, args.leader_elect_retry_period
        ),
        peering_name=args.peering,
        priority=args.priority,
        liveness_port=args.liveness_port or None,
        metrics_port=args.metrics_port or None,
        **_metrics_namespaces(args),
        runtime_image=_runtime_image(args),
        slow_retry_s=args.slow_retry_period or SLOW_RETRY_SECONDS,
        log_format=args.log_format,
        verbose=args.verbose,
        debug=args.debug,
    )
    configure_logging(options)
    asyncio.run(run_operator(options))
    return 0


def _metrics_namespaces(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    if args.metrics_namespaces is None:
        return {}  # the operator's default
    return {"metrics_namespaces": tuple(ns for ns in args.metrics_namespaces if ns)}


def _runtime_image(args: argparse.Namespace) -> str:
    from carpool.operator.spec import DEFAULT_IMAGE

    return str(args.runtime_image or DEFAULT_IMAGE)


def _print_crd(args: argparse.Namespace) -> int:
    from carpool.operator.crd import render_crd

    sys.stdout.write(render_crd())
    return 0


def _render(args: argparse.Namespace) -> int:
    from carpool.operator.render import RenderError, render
    from carpool.operator.validation import SpecError

    try:
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text()
        sys.stdout.write(
            render(
                text,
                namespace=args.namespace,
                runtime_image=_runtime_image(args),
                **_metrics_namespaces(args),
            )
        )
    except OSError as exc:
        raise SystemExit(f"carpool render: cannot read {args.filename}: {exc.strerror}") from None
    except (RenderError, SpecError) as exc:
        raise SystemExit(f"carpool render: {exc}") from None
    return 0


_OPERATOR_COMMANDS = {"operator": _run_operator, "crd": _print_crd, "render": _render}


if __name__ == "__main__":
    sys.exit(main())
