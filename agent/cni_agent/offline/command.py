"""The `config` verbs as the entry point runs them: (verb, --config, --json) -> exit status."""

from __future__ import annotations

import sys

from cni_agent.config import ConfigFileError, load_config
from cni_agent.offline.check import EXIT_CLEAN, EXIT_PROBLEMS, check
from cni_agent.offline.show import render_json, render_text
from cni_agent.webconfig import read_web_config

EXIT_UNUSABLE = 2  # the configuration does not load: as `cni-agent run` exits


def run(verb: str, path: str | None, as_json: bool = False) -> int:
    try:
        return _run(verb, path, as_json)
    except BrokenPipeError:  # `cni-agent config show | head`: stop quietly
        return EXIT_CLEAN


def _run(verb: str, path: str | None, as_json: bool) -> int:
    try:
        cfg = load_config(path)
    except ConfigFileError as e:
        print(f"cni-agent: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    if verb == "show":
        print(render_json(cfg) if as_json else render_text(cfg))
        return EXIT_CLEAN
    try:
        read_web_config(cfg)  # a bad one stops the daemon's start as a bad key does
    except ConfigFileError as e:
        print(f"cni-agent: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    report = check(cfg)
    for line in (*report.problems, *report.warnings):
        print(line)
    if report.problems:
        return EXIT_PROBLEMS
    print(report.summary(cfg))
    return EXIT_CLEAN
