"""http.web_config: the exporter-toolkit file read and checked (webconfig.py), and
basic auth's checker (service/basicauth.py). Over a real connection:
tests/daemon/test_http_tls.py."""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml

from cni_agent.config import AgentConfig, ConfigFileError, HTTPConfig, load_config
from cni_agent.service import basicauth
from cni_agent.service.basicauth import BasicAuth, credentials
from cni_agent.service.reconfig import merge
from cni_agent.webconfig import load_web_config, read_web_config
from tests.support.tls import PKI, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def hashed(password: str, prefix: str = "$2b$") -> str:
    """A bcrypt hash at the lowest cost (quick), as htpasswd (`$2y$`) or Python's bcrypt writes it."""
    return prefix + bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()[4:]


def write(tmp_path: Path, doc: Any) -> str:
    path = tmp_path / "web-config.yml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


def error(tmp_path: Path, doc: Any) -> str:
    with pytest.raises(ConfigFileError) as e:
        load_web_config(write(tmp_path, doc))
    return str(e.value)


def test_tls_and_users_as_exporters_write_them(tmp_path: Path, pki: PKI) -> None:
    # Relative paths are the file's directory's, as exporter-toolkit has them.
    (tmp_path / "tls").mkdir()
    for f in (pki.server_cert, pki.server_key, pki.ca):
        (tmp_path / "tls" / f.name).write_bytes(f.read_bytes())
    web = load_web_config(write(tmp_path, {
        "tls_server_config": {"cert_file": "tls/server.crt", "key_file": "tls/server.key",
                              "client_auth_type": "RequireAndVerifyClientCert",
                              "client_ca_file": "tls/ca.crt", "min_version": "TLS13"},
        "basic_auth_users": {"prometheus": hashed("s3cret", "$2y$"), "grafana": hashed("x")},
    }))
    assert web.tls is not None and web.tls.verify_mode == ssl.CERT_REQUIRED
    assert web.tls.minimum_version == ssl.TLSVersion.TLSv1_3
    assert sorted(web.users) == ["grafana", "prometheus"]
    assert web.tls_fingerprint


def test_an_empty_file_guards_nothing_and_a_users_only_file_is_plain_http(tmp_path: Path) -> None:
    web = load_web_config(write(tmp_path, ""))
    assert web.tls is None and not web.users
    web = load_web_config(write(tmp_path, {"basic_auth_users": {"p": hashed("x")}}))
    assert web.tls is None and list(web.users) == ["p"]


def test_the_fingerprint_follows_the_certificates_bytes(tmp_path: Path, pki: PKI) -> None:
    cert, key = tmp_path / "s.crt", tmp_path / "s.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    doc = {"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}}
    first = load_web_config(write(tmp_path, doc)).tls_fingerprint
    assert load_web_config(write(tmp_path, doc)).tls_fingerprint == first
    cert.write_bytes(pki.client_cert.read_bytes())  # renewed (any other certificate)
    key.write_bytes(pki.client_key.read_bytes())
    assert load_web_config(write(tmp_path, doc)).tls_fingerprint != first


@pytest.mark.parametrize(("doc", "message"), [
    ({"tls_server_config": {"cert_file": "nope.crt", "key_file": "nope.key"}},
     "tls_server_config.cert_file: {dir}/nope.crt: no such file"),
    ({"tls_server_config": {"cert_file": "{server_cert}"}},
     "tls_server_config: needs both cert_file and key_file"),
    ({"tls_server_config": {"cert_file": "{server_cert}", "key_file": "{wrong_key}"}},
     "tls_server_config.cert_file/key_file: {server_cert}, {wrong_key}: cannot be used"),
    ({"tls_server_config": {"cert_file": "{server_cert}", "key_file": "{server_key}",
                            "client_ca_file": "{ca}"}},
     "tls_server_config.client_ca_file: set, but client_auth_type does not verify"),
    ({"tls_server_config": {"cert_file": "{server_cert}", "key_file": "{server_key}",
                            "client_auth_type": "RequireAndVerifyClientCert"}},
     "tls_server_config.client_auth_type: RequireAndVerifyClientCert needs client_ca_file"),
    ({"tls_server_config": {"cert_file": "{server_cert}", "key_file": "{server_key}",
                            "client_auth_type": "RequireAnyClientCert", "client_ca_file": "{ca}"}},
     "tls_server_config.client_auth_type: RequireAnyClientCert takes a client certificate "
     "without verifying it"),
    ({"tls_server_config": {"cert_file": "{server_cert}", "key_file": "{server_key}",
                            "client_auth_type": "Whatever"}},
     "tls_server_config.client_auth_type: must be one of NoClientCert"),
    ({"tls_server_config": {"cert_file": "{server_cert}", "key_file": "{server_key}",
                            "client_auth_type": "VerifyClientCertIfGiven",
                            "client_ca_file": "{server_key}"}},
     "tls_server_config.client_ca_file: {server_key}: not a CA certificate"),
    ({"tls_server_config": {"cert_file": "{server_cert}", "key_file": "{server_key}",
                            "min_version": "TLS1.2"}},
     "tls_server_config.min_version: must be one of TLS10, TLS11, TLS12, TLS13, not 'TLS1.2'"),
    ({"tls_server_config": {"cert_file": "{server_cert}", "key_file": "{server_key}",
                            "cipher_suites": ["TLS_AES_128_GCM_SHA256"]}},
     "tls_server_config.cipher_suites: not supported by cni-agent (exporter-toolkit has it): "
     "remove it"),
    ({"tls_server_config": {"cert_file": "{server_cert}", "key_file": "{server_key}",
                            "certfile": "x"}},
     "tls_server_config.certfile: unknown key"),
    ({"http_server_config": {"http2": False}},
     "http_server_config: not supported by cni-agent"),
    ({"basic_auth_user": {}}, "basic_auth_user: unknown key"),
    ({"basic_auth_users": {"prometheus": "s3cret"}},
     "basic_auth_users.prometheus: must be a bcrypt hash"),
    ({"basic_auth_users": {"a:b": "$2y$10$" + "a" * 53}},
     "basic_auth_users.a:b: a user name must be a non-empty string without ':'"),
    ({"basic_auth_users": {"p": "$2y$03$" + "a" * 53}},
     "basic_auth_users.p: the bcrypt cost must be 4 to 31"),
    ({"basic_auth_users": ["p"]}, "basic_auth_users: must be a mapping"),
    ("[1, 2]", "the top level must be a mapping of keys"),
])
def test_a_bad_file_is_named_with_its_key(tmp_path: Path, pki: PKI, doc: Any, message: str) -> None:
    names = {k: str(getattr(pki, k)) for k in ("server_cert", "server_key", "wrong_key", "ca")}
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
    for k, v in names.items():
        text = text.replace("{" + k + "}", v)
        message = message.replace("{" + k + "}", v)
    message = message.replace("{dir}", str(tmp_path))
    got = error(tmp_path, text)
    assert got.startswith(f"{tmp_path}/web-config.yml: "), got
    assert message in got, got


def test_the_agents_config_names_the_key_and_where_it_was_set(tmp_path: Path) -> None:
    conf = tmp_path / "agent.yaml"
    conf.write_text(f"http: {{listen: '127.0.0.1:9750', web_config: {tmp_path}/web.yml}}\n")
    cfg = load_config(str(conf))
    with pytest.raises(ConfigFileError) as e:
        read_web_config(cfg)
    assert str(e.value) == f"http.web_config ({conf}): {tmp_path}/web.yml: no such file"
    conf.write_text("http: {web_config: web.yml}\n")
    with pytest.raises(ConfigFileError) as e:
        load_config(str(conf))
    assert "http.web_config: must be an absolute path" in str(e.value)


# --- basic auth --------------------------------------------------------------------------


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_credentials_are_read_as_browsers_and_prometheus_send_them() -> None:
    assert credentials(basic("prometheus", "pa:ss")) == ("prometheus", b"pa:ss")
    assert credentials("basic " + base64.b64encode(b"u:").decode()) == ("u", b"")
    for bad in (None, "", "Bearer abc", "Basic !!!", "Basic " + base64.b64encode(b"nocolon").decode()):
        assert credentials(bad) is None, bad


async def test_a_verified_credential_costs_one_bcrypt_per_minute(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bytes] = []
    real = basicauth._checkpw

    def counting(password: bytes, hashed_: bytes) -> bool:
        calls.append(password)
        return real(password, hashed_)

    monkeypatch.setattr(basicauth, "_checkpw", counting)
    now = [1000.0]
    auth = BasicAuth({"prometheus": hashed("s3cret").encode()}, clock=lambda: now[0])
    for _ in range(4):  # a minute of scrapes every 15 s
        assert await auth.allowed(basic("prometheus", "s3cret"))
        now[0] += 14
    assert calls == [b"s3cret"]
    now[0] += 10  # the memory has expired: bcrypt again
    assert await auth.allowed(basic("prometheus", "s3cret"))
    assert len(calls) == 2
    # A wrong password is never served from the memory, and is never remembered.
    assert not await auth.allowed(basic("prometheus", "s3cret!"))
    assert not await auth.allowed(basic("prometheus", "s3cret!"))
    assert len(calls) == 4
    # An unknown user costs a bcrypt too (its timing tells nothing), and fails.
    assert not await auth.allowed(basic("root", "s3cret"))
    assert len(calls) == 5
    assert not await auth.allowed(None)
    assert len(calls) == 5


async def test_a_password_longer_than_bcrypt_reads_is_compared_as_bcrypt_hashed_it() -> None:
    long = "x" * 80
    # As htpasswd and older bcrypt modules made it: from the first 72 bytes.
    auth = BasicAuth({"p": bcrypt.hashpw(long[:72].encode(), bcrypt.gensalt(4))})
    assert await auth.allowed(basic("p", long))
    assert not await auth.allowed(basic("p", "y" * 80))


async def test_bcrypt_runs_off_the_loop_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    running, most = 0, 0

    def slow(password: bytes, hashed_: bytes) -> bool:
        nonlocal running, most
        running += 1
        most = max(most, running)
        time.sleep(0.05)
        running -= 1
        return False

    monkeypatch.setattr(basicauth, "_checkpw", slow)
    auth = BasicAuth({"p": hashed("x").encode()})
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    results = await asyncio.gather(*(auth.allowed(basic("p", f"guess{n}")) for n in range(5)))
    ticker.cancel()
    assert results == [False] * 5 and most == 1
    assert ticks >= 10  # the loop went on while the checks ran


def test_a_reload_takes_web_config_at_once_and_listen_at_the_next_restart(
    caplog: pytest.LogCaptureFixture
) -> None:
    old = AgentConfig(http=HTTPConfig(listen="127.0.0.1:9750"))
    new = AgentConfig(http=HTTPConfig(listen="0.0.0.0:9750", web_config="/etc/cni-agent/web.yml"),
                      log_level="debug")
    applied: list[AgentConfig] = []
    with caplog.at_level("INFO"):
        effective = merge(old, new, applied.append)
    assert effective.http == HTTPConfig(listen="127.0.0.1:9750", web_config="/etc/cni-agent/web.yml")
    assert effective.log_level == "debug" and applied == [effective]
    assert "http.listen changed to '0.0.0.0:9750' (default); it takes effect at the next restart" \
        in caplog.text
    assert "reload: http.web_config is now '/etc/cni-agent/web.yml'" in caplog.text
