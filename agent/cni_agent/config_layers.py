"""Which configuration files are read, in which order: systemd's rules.

`/usr/lib/cni-agent/agent.yaml` (the package's defaults), then
`/etc/cni-agent/agent.yaml` (the admin's); then the drop-ins `*.yaml` of
`/usr/lib/cni-agent/agent.yaml.d/` and `/etc/cni-agent/agent.yaml.d/`, merged
in lexical order of file name, where a name in /etc masks the same name in
/usr/lib. A file that is empty or a symlink to /dev/null contributes nothing,
so it masks (an `/etc/cni-agent/agent.yaml` linked to /dev/null masks the
/usr/lib one). `--config FILE` reads FILE and then `FILE.d/*.yaml`.

Only names here: reading and merging is `cni_agent.config`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

USR_DIR = "/usr/lib/cni-agent"
ETC_DIR = "/etc/cni-agent"
CONFIG_NAME = "agent.yaml"
DROPIN_SUFFIX = ".yaml"


def masked(path: str) -> bool:
    """True for a file that says "nothing here": empty, or a link to /dev/null."""
    if os.path.realpath(path) == os.devnull:
        return True
    try:
        return os.path.isfile(path) and os.path.getsize(path) == 0
    except OSError:
        return False  # reading it reports why


def _dropins(directory: str) -> dict[str, str]:
    """name -> path of the drop-ins of one directory; a missing one has none."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {n: os.path.join(directory, n) for n in names
            if n.endswith(DROPIN_SUFFIX) and not n.startswith(".")}


def config_files(path: str | None, dirs: Sequence[str]) -> tuple[str, ...]:
    """The files to read, in order (OSError when a drop-in directory cannot be listed).

    With `path`, that file and its `path.d/`; else `dirs`' main files and
    drop-ins, a later directory winning (dirs = (/usr/lib…, /etc…)).
    """
    if path is not None:
        mains, dropin_dirs = [path], [path + ".d"]
    else:
        mains = [os.path.join(d, CONFIG_NAME) for d in dirs]
        dropin_dirs = [os.path.join(d, CONFIG_NAME + ".d") for d in dirs]
    files: list[str] = []
    for main in mains:
        if os.path.realpath(main) == os.devnull:
            files.clear()  # masks the layers below it
        elif os.path.lexists(main):
            files.append(main)
    by_name: dict[str, str] = {}
    for d in dropin_dirs:
        by_name.update(_dropins(d))  # a later directory's file masks the same name
    files += [by_name[n] for n in sorted(by_name) if not masked(by_name[n])]
    return tuple(files)
