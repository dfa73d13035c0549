"""A private CA and its certificates, made with the openssl command for one test.

`make_pki(dir)` writes a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate, a second CA (whose client certificate the
agent must refuse) and a server key that matches no certificate. Keys are
EC P-256: quick to make, and what a modern cert-manager issues.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PKI:
    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    stranger_cert: Path  # signed by other_ca
    stranger_key: Path
    wrong_key: Path  # matches no certificate


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _key(path: Path) -> Path:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    return path


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key = _key(d / f"{name}.key")
    cert = d / f"{name}.crt"
    _openssl("req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def issue(d: Path, name: str, ca: tuple[Path, Path], *, server: bool, serial: int = 1) -> tuple[Path, Path]:
    """A certificate for `name` signed by `ca` (cert, key): for a server, valid for
    127.0.0.1 and localhost; else a client's."""
    key = _key(d / f"{name}.key")
    csr = d / f"{name}.csr"
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext = d / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
                   if server else "extendedKeyUsage=clientAuth\n")
    cert = d / f"{name}.crt"
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-set_serial", str(serial), "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return cert, key


def make_pki(d: Path) -> PKI:
    d.mkdir(parents=True, exist_ok=True)
    ca = _ca(d, "ca")
    other = _ca(d, "other-ca")
    server = issue(d, "server", ca, server=True)
    client = issue(d, "prometheus", ca, server=False, serial=2)
    stranger = issue(d, "stranger", other, server=False, serial=3)
    return PKI(d, ca[0], server[0], server[1], client[0], client[1], other[0], stranger[0],
               stranger[1], _key(d / "wrong.key"))
