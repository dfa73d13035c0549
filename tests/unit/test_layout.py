"""The CLI's start-up pays for nothing of the daemon (the layout issue's goal).

import-linter checks the import statements (`make lint`); this checks what a
`cni-agent` command really loads, lazy imports included, in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

DAEMON_SIDE = ("cni_agent.service", "cni_agent.sandboxes", "cni_agent.readiness", "cni_agent.node")


def loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    # -s -P, not -I: isolated from the user's site and the working directory,
    # but with this interpreter's path (PYTHONPATH: an RPM's %check tests the
    # buildroot's copy, which no site directory names).
    out = subprocess.run([sys.executable, "-s", "-P", "-c", probe], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": ":".join(p for p in sys.path if p)})
    return list(json.loads(out.stdout.splitlines()[-1]))


def test_a_client_command_loads_nothing_of_the_daemon() -> None:
    # `--help` of a client command parses everything the command would; the
    # client module is what `status` and friends run on.
    modules = loaded_after("import cni_agent.main, cni_agent.cli.client\n"
                           "try:\n    cni_agent.main.main(['status', '--help'])\n"
                           "except SystemExit:\n    pass")
    assert "cni_agent.cli.client" in modules
    daemon = [m for m in modules if m.startswith(DAEMON_SIDE)]
    assert daemon == []


def test_run_is_the_one_door_to_the_daemon() -> None:
    modules = loaded_after("import cni_agent.main\ncni_agent.main.run_daemon.__code__")
    assert "cni_agent.service.daemon" not in modules
    modules = loaded_after("import cni_agent.service.daemon")
    assert "cni_agent.service.daemon" in modules and "cni_agent.cli.commands" not in modules


def test_config_check_reads_as_the_daemon_without_loading_it() -> None:
    modules = loaded_after("import cni_agent.main\n"
                           "cni_agent.main.main(['config', 'show', '--config', '/dev/null'])")
    assert "cni_agent.offline.show" in modules
    assert [m for m in modules if m.startswith(DAEMON_SIDE)] == []
    modules = loaded_after("import cni_agent.main\ntry:\n"
                           "    cni_agent.main.main(['status', '--help'])\n"
                           "except SystemExit:\n    pass")
    assert [m for m in modules if m.startswith(("cni_agent.offline", "cni_agent.config"))] == []
