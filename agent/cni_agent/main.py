"""`cni-agent`: the commands of `cli/` and, for `cni-agent run`, the daemon.

The one module that reaches both sides: the CLI never imports the daemon, and
the daemon is imported only when `run` asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cni_agent.cli.commands import main as commands


def main(argv: Sequence[str] | None = None) -> int:
    return commands(argv, run_daemon=run_daemon)


def run_daemon(config: str | None, bus: str | None) -> int:
    from cni_agent.service.daemon import run

    return run(config, bus)
