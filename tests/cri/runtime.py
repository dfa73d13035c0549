"""What containerd and CRI-O share as these tests run them: a CRI server as a
subprocess in a private corner (`top`) with a directory holding the shim, the
test's bus and its agent's socket in its environment (libcni hands it to
plugins), and an end that leaves nothing of it on the machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import grpc

from tests.cri.cri import CRI
from tests.support.shim import SHIM


def toml_str(value: object) -> str:
    return json.dumps(str(value))  # a TOML basic string is a JSON string here


class Runtime:
    name = ""  # its binary's: the socket's and the log's file names
    title = ""  # in messages

    def __init__(self, top: Path, bus_address: str, shim_socket: Path | None) -> None:
        """`shim_socket`: the agent's socket for the shim (None: the bus alone)."""
        self.top = top
        self.socket = str(top / f"{self.name}.sock")
        self.conf_dir = top / "net.d"
        self.bin_dir = top / "cni-bin"
        for d in (self.conf_dir, self.bin_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.symlink(SHIM, self.bin_dir / "cni-agent-shim")
        self.env = {"PATH": os.environ["PATH"], "DBUS_SYSTEM_BUS_ADDRESS": bus_address,
                    "CNI_AGENT_SHIM_SOCKET": str(shim_socket or "")}
        self.log_path = top / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.cri = CRI(self.socket)

    def command(self) -> list[str]:
        raise NotImplementedError

    def load_image(self, archive: Path) -> None:
        """The pause image, from an OCI archive: no registry, no pull."""
        raise NotImplementedError

    def start(self, timeout: float = 30) -> None:
        """Started, and back once its CRI says RuntimeReady."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.log()}")
            try:
                if self.cri.conditions()["RuntimeReady"][0]:
                    return
            except (grpc.RpcError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.title}'s CRI not up within {timeout}s:\n{self.log()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def kill_leftovers(self) -> None:
        """What it started that outlives it (none by default)."""

    def close(self) -> None:
        """Everything gone: the pods (their DELs reach the agent), the runtime,
        what it left running, the mounts under `top`, and `top`."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                for sandbox in self.cri.sandboxes():
                    self.cri.stop(sandbox)
                    self.cri.remove(sandbox)
            except grpc.RpcError:
                pass
        self.stop()
        self.cri.close()
        self.kill_leftovers()
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(str(self.top))), reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(self.top, ignore_errors=True)
