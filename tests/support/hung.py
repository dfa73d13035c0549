"""A really hung mount, without a FUSE library: we open /dev/fuse, mount it,
answer the kernel's INIT and then nothing. Any lookup below it blocks in the
kernel (as on a dead NFS server) until `release`, which aborts the connection."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_FUSE_INIT = 26


class HungMount:
    def __init__(self, where: Path) -> None:
        where.mkdir()
        self.where = where
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
        if _libc.mount(b"cni-agent-test-hung", str(where).encode(), b"fuse", 0, opts) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"mount fuse: {os.strerror(err)}")
        request = os.read(self.fd, 1 << 17)
        _, opcode, unique = struct.unpack_from("<IIQ", request)
        assert opcode == _FUSE_INIT, opcode
        init_out = struct.pack("<IIIIHHIIHHI7I", 7, 31, 0, 0, 0, 0, 4096, 0, 0, 0, 0, *[0] * 7)
        os.write(self.fd, struct.pack("<IiQ", 16 + len(init_out), 0, unique) + init_out)

    def release(self) -> None:
        """Abort the connection (blocked lookups fail) and unmount."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            subprocess.run(["umount", "-l", str(self.where)], check=False)
