"""`cni-agent`: the commands of `cli/` and, for `cni-agent run`, the daemon.

The one module that reaches both sides: the CLI never imports the daemon, and
the daemon is imported only when `run` asks for it; the offline `config`
verbs (`cni_agent.offline`, which read the configuration as the daemon does)
only when they are asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["run"]:
        # The daemon's start (systemd's ExecStart, every test's agent): its two
        # options, without the CLI's modules and parser.
        from cni_agent.cli.runargs import run_parser

        args = run_parser().parse_args(words[1:])
        return run_daemon(args.config, getattr(args, "bus", None))
    from cni_agent.cli.commands import main as commands

    return commands(words, run_daemon=run_daemon, run_config=run_config,
                    read_capabilities=read_capabilities, read_state_dir=read_state_dir)


def run_daemon(config: str | None, bus: str | None) -> int:
    from cni_agent.service.daemon import run

    return run(config, bus)


def run_config(verb: str, config: str | None, as_json: bool) -> int:
    """`cni-agent config show|check`: reads what the daemon reads, imported only for them."""
    from cni_agent.offline.command import run

    return run(verb, config, as_json)


def read_capabilities(config: str | None, network: str) -> tuple[frozenset[str] | None, str]:
    """`cni-agent shim-config`: what the agent network's plugins declare, read offline."""
    from cni_agent.offline.capabilities import network_capabilities

    return network_capabilities(config, network)


def read_state_dir(config: str | None) -> tuple[str | None, str]:
    """`cni-agent shim-config`: the agent's state_dir (where the shim queues DELs), read offline."""
    from cni_agent.offline.capabilities import state_dir

    return state_dir(config)
