"""http.web_config on a real agent: TLS, client certificates and basic auth seen
by real clients (urllib and Python's ssl, a real Prometheus), a CA made with
openssl for the test; reloads that change users and certificates, and files
that do not load (docs/monitoring.md, "Scraping a fleet")."""

from __future__ import annotations

import base64
import re
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml

from cni_agent.service.httpd import CHALLENGE
from tests.support.agent import REPO, Agent
from tests.support.docs import section
from tests.support.prometheus import Prometheus, free_port
from tests.support.tls import PKI, issue, make_pki

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def bcrypt_hash(password: str) -> str:
    # As htpasswd -nBC writes it ($2y$), at the lowest cost: the test is not about cost.
    return "$2y$" + bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()[4:]


def client_context(pki: PKI, *, cert: tuple[Path, Path] | None = None,
                   trust: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(trust or pki.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx


def get(url: str, ctx: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None
        ) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of a GET; an HTTP error status is an answer too."""
    req = urllib.request.Request(url)
    if auth is not None:
        req.add_header("Authorization",
                       "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def refused(url: str, ctx: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None) -> str:
    """The connection (not the HTTP answer) fails: what the client said."""
    with pytest.raises(OSError) as e:
        get(url, ctx, auth)
    assert not isinstance(e.value, urllib.error.HTTPError), e.value
    return str(e.value)


def serial(port: int, pki: PKI, auth_cert: tuple[Path, Path] | None = None) -> int:
    """The serial number of the certificate the agent shows now."""
    ctx = client_context(pki, cert=auth_cert)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        cert = tls.getpeercert()
        assert cert is not None
        return int(str(cert["serialNumber"]), 16)


def test_tls_client_certificates_and_basic_auth_with_a_real_client(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path, pki: PKI,
) -> None:
    testnet()
    web = tmp_path / "web-config.yml"
    web.write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
                              "client_auth_type": "RequireAndVerifyClientCert",
                              "client_ca_file": str(pki.ca)},
        "basic_auth_users": {"prometheus": bcrypt_hash("s3cret")},
    }))
    port = free_port()
    agent = make_agent(http={"listen": f"127.0.0.1:{port}", "web_config": str(web)})
    base = f"https://127.0.0.1:{port}"
    ok = client_context(pki, cert=(pki.client_cert, pki.client_key))

    status, _, body = get(f"{base}/metrics", ok, ("prometheus", "s3cret"))
    assert status == 200 and "cni_agent_network_ready 1.0" in body
    assert get(f"{base}/readyz", ok, ("prometheus", "s3cret"))[:1] == (200,)
    for auth in (("prometheus", "wrong"), ("root", "s3cret"), None):
        status, headers, _ = get(f"{base}/metrics", ok, auth)
        assert status == 401 and headers["WWW-Authenticate"] == CHALLENGE, (auth, status)
    assert get(f"{base}/healthz", ok)[0] == 401  # every path

    # TLS itself: no client certificate, one from another CA, plain HTTP, and a
    # client that does not trust the agent's CA all fail before any HTTP.
    refused(f"{base}/metrics", client_context(pki), ("prometheus", "s3cret"))
    refused(f"{base}/metrics", client_context(pki, cert=(pki.stranger_cert, pki.stranger_key)),
            ("prometheus", "s3cret"))
    refused(f"http://127.0.0.1:{port}/metrics", None, ("prometheus", "s3cret"))
    said = refused(f"{base}/metrics", client_context(pki, cert=(pki.client_cert, pki.client_key),
                                                     trust=pki.other_ca))
    assert "CERTIFICATE_VERIFY_FAILED" in said
    assert f"serving /healthz, /readyz and /metrics on 127.0.0.1:{port} (TLS, basic auth " \
           "(1 user(s)))" in agent.log()


def test_a_reload_reads_the_file_again_and_a_bad_one_changes_nothing(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path, pki: PKI,
) -> None:
    testnet()
    tls = tmp_path / "tls"
    tls.mkdir()
    shutil.copy(pki.server_cert, tls / "node.crt")
    shutil.copy(pki.server_key, tls / "node.key")
    web = tmp_path / "web-config.yml"

    def write(users: dict[str, str], with_tls: bool = True) -> None:
        doc: dict[str, Any] = {"basic_auth_users": users}
        if with_tls:  # relative paths: from the file's directory
            doc["tls_server_config"] = {"cert_file": "tls/node.crt", "key_file": "tls/node.key"}
        web.write_text(yaml.safe_dump(doc))

    write({"a": bcrypt_hash("one")})
    port = free_port()
    agent = make_agent(http={"listen": f"127.0.0.1:{port}", "web_config": str(web)})
    base = f"https://127.0.0.1:{port}/metrics"
    ctx = client_context(pki)
    assert get(base, ctx, ("a", "one"))[0] == 200
    assert serial(port, pki) == 1

    # A password where a hash belongs: the reload is refused, naming the file
    # and the key, and the users and the listener are as they were.
    write({"a": "one"})
    out = agent.gdbus("Reload")
    assert out.returncode != 0 and "InvalidArgument" in out.stderr, out.stderr
    assert f"{web}: basic_auth_users.a: must be a bcrypt hash" in out.stderr
    assert "the configuration in use is kept" in out.stderr
    assert get(base, ctx, ("a", "one"))[0] == 200

    # Another user, and a renewed certificate in the same files: both at the reload.
    write({"b": bcrypt_hash("two")})
    cert, key = issue(tmp_path, "renewed", (pki.ca, pki.dir / "ca.key"), server=True, serial=9)
    shutil.copy(cert, tls / "node.crt")
    shutil.copy(key, tls / "node.key")
    assert agent.call("Reload") is None
    assert get(base, ctx, ("a", "one"))[0] == 401
    assert get(base, ctx, ("b", "two"))[0] == 200
    assert serial(port, pki) == 9
    assert "http.web_config: TLS, basic auth (1 user(s)) (listening again)" in agent.log()

    # TLS dropped: plain HTTP on the same port, basic auth still asked for.
    write({"b": bcrypt_hash("two")}, with_tls=False)
    assert agent.call("Reload") is None
    assert get(f"http://127.0.0.1:{port}/metrics", None, ("b", "two"))[0] == 200
    assert get(f"http://127.0.0.1:{port}/metrics")[0] == 401
    refused(base, ctx, ("b", "two"))


def test_a_web_config_that_does_not_load_stops_the_start(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path, pki: PKI,
) -> None:
    testnet()
    web = tmp_path / "web-config.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "nope.crt",
                                                         "key_file": str(pki.server_key)}}))
    agent = make_agent(start=False, http={"listen": f"127.0.0.1:{free_port()}",
                                          "web_config": str(web)})
    agent.write_config()
    message = (f"cni-agent: http.web_config ({agent.config_path}): {web}: "
               f"tls_server_config.cert_file: {tmp_path}/nope.crt: no such file")
    check = subprocess.run([sys.executable, "-m", "cni_agent", "config", "check", "--config",
                            str(agent.config_path)], capture_output=True, text=True)
    assert (check.returncode, check.stderr.strip()) == (2, message)
    agent.start(wait=False)
    assert agent.proc is not None and agent.proc.wait(20) == 2
    assert message in agent.log()


def fenced_yaml(text: str) -> list[Any]:
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def test_prometheus_scrapes_with_the_documented_configuration(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path, pki: PKI,
) -> None:
    """The agent's web config and Prometheus's scrape config as
    docs/monitoring.md gives them, only the paths, the port and the password
    filled in: Prometheus scrapes over TLS with its client certificate and
    basic auth, and the target's instance is the node's name."""
    page = section((REPO / "docs" / "monitoring.md").read_text(), "Scraping a fleet")
    blocks = fenced_yaml(page)
    web_doc = next(b for b in blocks if "tls_server_config" in b)
    job = next(b for b in blocks if "scrape_configs" in b)["scrape_configs"][0]

    # The agent's side: the documented file, its relative paths under tmp_path.
    tls_conf = web_doc["tls_server_config"]
    for key, src in (("cert_file", pki.server_cert), ("key_file", pki.server_key),
                     ("client_ca_file", pki.ca)):
        dest = tmp_path / tls_conf[key]
        dest.parent.mkdir(exist_ok=True)
        shutil.copy(src, dest)
    [user] = web_doc["basic_auth_users"]
    web_doc["basic_auth_users"][user] = bcrypt_hash("scrape-me")
    web = tmp_path / "web-config.yml"
    web.write_text(yaml.safe_dump(web_doc))
    testnet()
    port = free_port()
    make_agent(http={"listen": f"127.0.0.1:{port}", "web_config": str(web)})

    # Prometheus's side: the documented job.
    (tmp_path / "password").write_text("scrape-me\n")
    job["tls_config"].update(ca_file=str(pki.ca), cert_file=str(pki.client_cert),
                             key_file=str(pki.client_key))
    assert job["basic_auth"]["username"] == user
    job["basic_auth"]["password_file"] = str(tmp_path / "password")
    targets = tmp_path / "cni-agent-nodes.yml"
    targets.write_text(yaml.safe_dump([{"targets": [f"127.0.0.1:{port}"]}]))
    job["file_sd_configs"] = [{"files": [str(targets)], "refresh_interval": "1s"}]
    prom = Prometheus(tmp_path, [], [], scrape_configs=[job])
    try:
        prom.wait('up{job="cni-agent", instance="127.0.0.1"} == 1', timeout=30)
        assert prom.query('cni_agent_network_ready{job="cni-agent", instance="127.0.0.1"} == 1')
    finally:
        prom.stop()
