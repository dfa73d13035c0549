"""`http.web_config`: TLS and basic auth for `http.listen`, as exporters take them.

The file is in the Prometheus exporter-toolkit's web-config format, so one
file (and one habit) serves node_exporter and the agent alike::

    tls_server_config:
      cert_file: server.crt            # relative paths: from the file's directory
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional
      client_ca_file: clients-ca.crt   # with a client_auth_type that verifies
      min_version: TLS12               # optional (TLS12 is the default)
    basic_auth_users:
      prometheus: $2y$10$...           # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':')

Everything is checked here, when the file is read (at start-up, at a reload,
by `cni-agent config check`): the certificate and key are loaded into the
TLS context the listener will use, so a key that does not match its
certificate is a configuration error naming the file and the key, never a
listener that fails its first handshake. Keys of the format the agent does
not implement (cipher_suites, http_server_config, ...) are refused by name
rather than ignored: a setting that silently does nothing is worse than none.

Shared at the side, like `config`: the daemon and `config check` read it.
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cni_agent import files
from cni_agent.config import AgentConfig, ConfigFileError, read_document

MAX_PEM_BYTES = 1024 * 1024  # a certificate chain or a CA bundle: a few KiB

# exporter-toolkit's client_auth_type values, as ssl's verify modes. Those that
# ask for a certificate without verifying it are refused: a certificate nobody
# checks proves nothing, and Python's ssl cannot ask for one without checking.
_VERIFYING = {"VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
              "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
_UNVERIFIED = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
_TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                 "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version",
             "max_version")
# In the format, not implemented here: refused by name.
_NOT_HERE = {"cert", "key", "client_ca", "cipher_suites", "curve_preferences",
             "prefer_server_cipher_suites", "client_allowed_sans", "http_server_config",
             "rate_limit"}
# $2a$, $2b$ or $2y$ (htpasswd's), a two-digit cost, 22 characters of salt and
# 31 of hash in bcrypt's base64.
_BCRYPT = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")


@dataclass(frozen=True)
class WebConfig:
    source: str
    # None: plain HTTP. Built and loaded when the file was read.
    tls: ssl.SSLContext | None = field(default=None, compare=False)
    # user -> bcrypt hash; empty: no authentication.
    users: Mapping[str, bytes] = field(default_factory=dict)
    # Of what the TLS context was built from (the settings and the bytes of
    # every file): a reload replaces the listener only when this changed.
    tls_fingerprint: str = ""


def _fail(source: str, key: str, what: str) -> ConfigFileError:
    return ConfigFileError(f"{source}: {key}: {what}")


def _read_pem(source: str, key: str, path: str) -> bytes:
    try:
        return files.read_regular(path, MAX_PEM_BYTES)
    except files.Unreadable as e:
        raise _fail(source, key, f"{path}: {'no such file' if e.missing else e}") from None


def _string(source: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(source, key, "must be a non-empty string")
    return value


def _tls(source: str, doc: Any) -> tuple[ssl.SSLContext, str]:
    section = "tls_server_config"
    if not isinstance(doc, dict):
        raise _fail(source, section, "must be a mapping")
    for key in doc:
        if key in _NOT_HERE:
            raise _fail(source, f"{section}.{key}", "not supported by cni-agent (exporter-toolkit "
                                                    "has it): remove it")
        if key not in _TLS_KEYS:
            raise _fail(source, f"{section}.{key}", "unknown key")
    here = os.path.dirname(source)

    def path(key: str) -> str:
        value = _string(source, f"{section}.{key}", doc.get(key))
        return os.path.join(here, value)  # an absolute value stays as it is

    if "cert_file" not in doc or "key_file" not in doc:
        raise _fail(source, section, "needs both cert_file and key_file")
    cert, key = path("cert_file"), path("key_file")
    digest = hashlib.sha256(repr(sorted((k, str(v)) for k, v in doc.items())).encode())
    for name, p in (("cert_file", cert), ("key_file", key)):
        digest.update(_read_pem(source, f"{section}.{name}", p))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # exporter-toolkit's default too
    for bound in ("min_version", "max_version"):
        if bound in doc:
            version = _TLS_VERSIONS.get(doc[bound]) if isinstance(doc[bound], str) else None
            if version is None:
                raise _fail(source, f"{section}.{bound}",
                            f"must be one of {', '.join(_TLS_VERSIONS)}, not {doc[bound]!r}")
            setattr(ctx, "minimum_version" if bound == "min_version" else "maximum_version",
                    version)
    try:
        # An empty password: an encrypted key fails here instead of prompting
        # on the agent's terminal (there is none under systemd).
        ctx.load_cert_chain(cert, key, password="")
    except (ssl.SSLError, OSError) as e:
        raise _fail(source, f"{section}.cert_file/key_file",
                    f"{cert}, {key}: cannot be used ({e.strerror or e}; an encrypted key is "
                    "not supported)") from None
    auth = doc.get("client_auth_type", "NoClientCert")
    if auth in _UNVERIFIED:
        raise _fail(source, f"{section}.client_auth_type",
                    f"{auth} takes a client certificate without verifying it, which proves "
                    "nothing: use RequireAndVerifyClientCert or VerifyClientCertIfGiven "
                    "with client_ca_file")
    if auth != "NoClientCert" and auth not in _VERIFYING:
        raise _fail(source, f"{section}.client_auth_type",
                    f"must be one of NoClientCert, {', '.join(_VERIFYING)}, not {auth!r}")
    if auth in _VERIFYING:
        if "client_ca_file" not in doc:
            raise _fail(source, f"{section}.client_auth_type",
                        f"{auth} needs client_ca_file, the CA that signs the clients' certificates")
        ca = path("client_ca_file")
        pem = _read_pem(source, f"{section}.client_ca_file", ca)
        digest.update(pem)
        try:
            ctx.load_verify_locations(cadata=pem.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise _fail(source, f"{section}.client_ca_file", f"{ca}: not a CA certificate ({e})") \
                from None
        ctx.verify_mode = _VERIFYING[auth]
    elif "client_ca_file" in doc:
        # As exporter-toolkit: a CA with nothing to verify is a mistake, not a no-op.
        raise _fail(source, f"{section}.client_ca_file",
                    "set, but client_auth_type does not verify client certificates "
                    "(RequireAndVerifyClientCert or VerifyClientCertIfGiven)")
    return ctx, digest.hexdigest()


def _users(source: str, doc: Any) -> dict[str, bytes]:
    if not isinstance(doc, dict):
        raise _fail(source, "basic_auth_users", "must be a mapping of user names to bcrypt hashes")
    users: dict[str, bytes] = {}
    for name, hashed in doc.items():
        key = f"basic_auth_users.{name}"
        if not isinstance(name, str) or not name or ":" in name:
            raise _fail(source, key, "a user name must be a non-empty string without ':'")
        m = _BCRYPT.fullmatch(hashed) if isinstance(hashed, str) else None
        if m is None:
            raise _fail(source, key, "must be a bcrypt hash ($2y$10$... as `htpasswd -nBC 10 "
                                     "USER` prints it after the colon), never a password")
        if not 4 <= int(m.group(1)) <= 31:
            raise _fail(source, key, "the bcrypt cost must be 4 to 31")
        users[name] = hashed.encode()
    return users


def load_web_config(path: str) -> WebConfig:
    """The web config `path` names, checked and loaded; ConfigFileError naming
    the file and the key otherwise."""
    doc = read_document(path)
    if doc is None:
        return WebConfig(path)  # empty: as exporter-toolkit, neither TLS nor auth
    if not isinstance(doc, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping of keys")
    for key in doc:
        if key in _NOT_HERE:
            raise _fail(path, str(key), "not supported by cni-agent (exporter-toolkit has it): "
                                        "remove it")
        if key not in ("tls_server_config", "basic_auth_users"):
            raise _fail(path, str(key), "unknown key")
    tls, fingerprint = None, ""
    if doc.get("tls_server_config") is not None:
        tls, fingerprint = _tls(path, doc["tls_server_config"])
    users = _users(path, doc["basic_auth_users"]) if doc.get("basic_auth_users") is not None else {}
    return WebConfig(path, tls, users, fingerprint)


def read_web_config(cfg: AgentConfig) -> WebConfig | None:
    """The file `http.web_config` names, checked and loaded (ConfigFileError
    naming the key, where it was set, the file and its key); None without one."""
    if not cfg.http.web_config:
        return None
    try:
        return load_web_config(cfg.http.web_config)
    except ConfigFileError as e:
        raise ConfigFileError(f"http.web_config ({cfg.origin('http.web_config')}): {e}") from None
