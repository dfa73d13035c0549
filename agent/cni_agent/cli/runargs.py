"""`cni-agent run`'s options, in a module of their own: the daemon's start
parses them without importing the rest of the CLI (~17 ms of CPU per start)."""

from __future__ import annotations

import argparse

RUN_HELP = "run the daemon in the foreground (systemd runs this)"
RUN_DESCRIPTION = "Run the agent in the foreground until SIGTERM."


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--config", metavar="PATH",
                     help="read PATH and PATH.d/*.yaml instead of the layers (default: "
                          "/usr/lib/cni-agent/agent.yaml, /etc/cni-agent/agent.yaml, then "
                          "the drop-ins of both agent.yaml.d/)")
    run.add_argument("--bus", metavar="BUS", default=argparse.SUPPRESS,
                     help="system (default), session, or a D-Bus address")


def run_parser() -> argparse.ArgumentParser:
    """The parser of `cni-agent run ARGS` (the words after `run`)."""
    parser = argparse.ArgumentParser(prog="cni-agent run", description=RUN_DESCRIPTION)
    add_run_arguments(parser)
    return parser
