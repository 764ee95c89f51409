"""The `carpool` command. Subcommands import what they need only when they run, so `--help` is fast
and the operator image (no torch) can use the same entry point."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError
from pydantic_settings import CliSettingsSource

from carpool.runtime.config import ConfigError, RuntimeConfig, load_config


def _config_parser(parser: argparse.ArgumentParser) -> CliSettingsSource[RuntimeConfig]:
    parser.add_argument(
        "--config",
        "-c",
        type=Path,
        default=None,
        help="YAML file with runtime settings (also CARPOOL_CONFIG; default /etc/carpool/runtime.yaml "
        "when it exists). Flags override environment variables, which override the file.",
    )
    return CliSettingsSource(
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

    show = commands.add_parser(
        "config",
        help="print the effective runtime configuration as YAML",
        description="Resolve defaults, the YAML file, CARPOOL_* variables and flags; print the result.",
    )
    show_source = _config_parser(show)

    args = parser.parse_args(argv)
    if args.command == "serve":
        config = _resolve(args, serve_source)
        from carpool.runtime.server import run

        return run(config)
    config = _resolve(args, show_source)
    sys.stdout.write(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
