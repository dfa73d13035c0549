"""The sandbox ("pause") image, built here from pause.c: no registry, no pull.

An OCI image layout in a tar, one uncompressed layer holding /pause, which
`ctr images import` takes as it is.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import subprocess
import tarfile
from pathlib import Path
from typing import Any

PAUSE_C = Path(__file__).resolve().parent / "pause.c"
IMAGE_NAME = "localhost/cni-agent-test/pause:1"
GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


def build_pause(out: Path) -> Path:
    """A static pause binary: the image has no libc to link against."""
    binary = out / "pause"
    subprocess.run(["gcc", "-static", "-Os", "-s", "-o", str(binary), str(PAUSE_C)], check=True)
    return binary


def _blob(tar: tarfile.TarFile, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _layer(pause: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        info = layer.gettarinfo(str(pause), "pause")
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mode = 0o755
        with open(pause, "rb") as f:
            layer.addfile(info, f)
    return buf.getvalue()


def build_image(out: Path) -> Path:
    """The OCI archive `ctr -n k8s.io images import` reads; returns its path."""
    layer = _layer(build_pause(out))
    config = {
        "architecture": GOARCH.get(platform.machine(), platform.machine()), "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
    }
    archive = out / "pause.oci.tar"
    with tarfile.open(archive, "w") as tar:
        layer_desc = _blob(tar, layer)
        config_desc = _blob(tar, json.dumps(config).encode())
        manifest = {
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer_desc}],
        }
        manifest_desc = _blob(tar, json.dumps(manifest).encode())
        index = {
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest_desc,
                           "annotations": {"io.containerd.image.name": IMAGE_NAME,
                                           "org.opencontainers.image.ref.name": "1"}}],
        }
        for name, doc in (("oci-layout", {"imageLayoutVersion": "1.0.0"}), ("index.json", index)):
            data = json.dumps(doc).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive
