"""The `cni-agent` command line: `run` (the daemon) and the client commands."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from cni_agent import __version__
from cni_agent.config import ConfigFileError, load_config

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _run(args: argparse.Namespace) -> int:
    from cni_agent.daemon import Daemon, StartupError
    from cni_agent.logs import setup_logging

    try:
        cfg = load_config(args.config)
    except ConfigFileError as e:
        print(f"cni-agent: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.bus:
        cfg = cfg.replace(bus=args.bus)
    setup_logging(cfg.log_level)
    try:
        return asyncio.run(Daemon(cfg).run())
    except StartupError as e:
        print(f"cni-agent: {e}", file=sys.stderr)
        return EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cni-agent",
        description="Node agent that owns CNI networking and reports network readiness on D-Bus.",
    )
    parser.add_argument("--version", action="version", version=f"cni-agent {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run the daemon in the foreground (systemd runs this)",
                         description="Run the agent in the foreground until SIGTERM.")
    run.add_argument("--config", metavar="PATH",
                     help="YAML configuration (default: /etc/cni-agent/agent.yaml if present)")
    run.add_argument("--bus", metavar="BUS",
                     help="system (default), session, or a D-Bus address")
    run.set_defaults(func=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    result: int = args.func(args)
    return result
