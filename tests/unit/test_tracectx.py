"""The W3C trace context of a call (cni/tracectx.py): what is accepted, what
plugins get (as libcni 1.3 passes it: containernetworking/cni#1173), and
that a call without one costs nothing and leaks into nothing."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from cni_agent.cni.config import parse_list
from cni_agent.cni.errors import InvalidArgument
from cni_agent.cni.exec import Invocation, ProcessExecutor
from cni_agent.cni.logctx import ContextFields
from cni_agent.cni.runtime import CNIRuntime, RuntimeConf
from cni_agent.cni.tracectx import CallTrace, TraceContext, current, parse_trace_context
from cni_agent.service.cnicall import parse_call
from cni_agent.service.dbus_service import parse_options
from cni_agent.service.tracing import Tracing
from tests.support.fakeexec import FakeExecutor
from tests.support.plugins import conflist

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TP = f"00-{TRACE_ID}-{PARENT_ID}-01"


def test_a_w3c_traceparent_is_read_and_written_as_libcni_writes_it() -> None:
    ctx = parse_trace_context({"TRACEPARENT": TP, "TRACESTATE": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
                               "BAGGAGE": "userId=alice,serverNode=DF%2028;prop"})
    assert ctx == TraceContext(TRACE_ID, PARENT_ID, True, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
                               "userId=alice,serverNode=DF%2028;prop")
    assert ctx.environ() == (("TRACEPARENT", TP), ("TRACESTATE", ctx.tracestate),
                             ("BAGGAGE", ctx.baggage))
    # Only the sampled flag, version 00 (otel-go's propagator, which libcni uses).
    later = parse_trace_context({"TRACEPARENT": f"01-{TRACE_ID}-{PARENT_ID}-03-future"})
    assert later is not None and later.traceparent == TP
    # Tracestate's members as otel-go writes them: no spaces, no empty members.
    spaced = parse_trace_context({"TRACEPARENT": TP, "TRACESTATE": " a=1 ,, b=2\t"})
    assert spaced is not None and spaced.tracestate == "a=1,b=2"
    unsampled = parse_trace_context({"TRACEPARENT": f"00-{TRACE_ID}-{PARENT_ID}-00"})
    assert unsampled is not None and unsampled.environ() == (
        ("TRACEPARENT", f"00-{TRACE_ID}-{PARENT_ID}-00"),)
    # A plugin's own parent, when the agent's spans are exported.
    assert ctx.environ("00f067aa0ba902b7")[0] == ("TRACEPARENT", f"00-{TRACE_ID}-00f067aa0ba902b7-01")


def test_without_a_traceparent_nothing_is_passed_on_as_libcni_does() -> None:
    assert parse_trace_context({}) is None
    assert parse_trace_context({"TRACEPARENT": "", "TRACESTATE": "", "BAGGAGE": ""}) is None
    assert parse_trace_context({"TRACESTATE": "a=b", "BAGGAGE": "k=v"}) is None


BAD = {
    "TRACEPARENT": [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # upper case
        f"00-{'0' * 32}-{PARENT_ID}-01",  # trace id zero
        f"00-{TRACE_ID}-{'0' * 16}-01",  # parent id zero
        f"ff-{TRACE_ID}-{PARENT_ID}-01",  # the forbidden version
        f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 is 55 characters
        f"01-{TRACE_ID}-{PARENT_ID}-01x",  # a later version adds fields after a dash only
        f" {TP}",
        f"00-{TRACE_ID}-{PARENT_ID}-01-" + "x" * 600,
    ],
    "TRACESTATE": ["Upper=1", "a=b,a=c", "k=v\x7f", "=v", "k=", "k=v=w", "a" * 257 + "=v",
                   ",".join(f"k{i}=v" for i in range(33)), "k=" + "v" * 8191],
    "BAGGAGE": ["k=v,", "k v=1", "k=a,b", 'k="v"', "k=v\\w", "k=é",
                ",".join(f"k{i}=v" for i in range(65)), "k=" + "v" * 8191],
}


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in BAD.items() for v in vs])
def test_what_is_not_w3c_is_refused_naming_the_field(name: str, value: str) -> None:
    values = {"TRACEPARENT": TP, name: value}
    with pytest.raises(InvalidArgument) as e:
        parse_trace_context(values, "options.")
    assert e.value.field == f"options.{name}"


def test_what_w3c_allows_is_accepted() -> None:
    for tracestate in ("", " a=1 , ,b=2\t", "tenant@vendor=x y", "a" * 256 + "=v",
                       ",".join(f"k{i}=v" for i in range(32))):
        parse_trace_context({"TRACEPARENT": TP, "TRACESTATE": tracestate})
    for baggage in ("k=", "k = v ; p ; q=1", "a=%20x,b=1", ",".join(f"k{i}=v" for i in range(64))):
        parse_trace_context({"TRACEPARENT": TP, "BAGGAGE": baggage})


def test_the_shim_and_dbus_read_it_and_refuse_it_with_their_own_words() -> None:
    conf = json.dumps({"cniVersion": "1.1.0", "name": "pods"})
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c", "CNI_NETNS": "/x", "CNI_IFNAME": "eth0",
           "TRACEPARENT": TP, "BAGGAGE": "k=v"}
    assert parse_call(env, conf).trace == TraceContext(TRACE_ID, PARENT_ID, True, "", "k=v")
    # STATUS runs no plugin: a runtime's trace context is not even read.
    assert parse_call({"CNI_COMMAND": "STATUS", "TRACEPARENT": "junk"}, conf).trace is None
    from cni_agent.service.cnicall import Refusal
    with pytest.raises(Refusal) as refused:
        parse_call({**env, "TRACEPARENT": "junk"}, conf)
    assert refused.value.code == 4 and refused.value.msg.startswith("TRACEPARENT: ")
    from dbus_fast import Variant
    opts = parse_options({"TRACEPARENT": Variant("s", TP)})
    assert opts["trace"].traceparent == TP
    assert "trace" not in parse_options({})
    with pytest.raises(InvalidArgument, match=r"^options\.TRACESTATE: "):
        parse_options({"TRACEPARENT": Variant("s", TP), "TRACESTATE": Variant("s", "A=1")})


NET = parse_list(conflist("n", [{"type": "fake"}, {"type": "fake2"}], "1.1.0"), "n")


async def _add(runtime: CNIRuntime, cid: str) -> None:
    await runtime.add(NET, RuntimeConf(cid, "/proc/self/ns/net", "eth0"))


async def test_every_plugin_of_a_traced_call_gets_its_context_and_no_other_call_does(
        tmp_path: Path) -> None:
    fake = FakeExecutor(plugins={"fake", "fake2"})
    runtime = CNIRuntime(("/fake",), str(tmp_path), executor=fake)
    ctx = TraceContext(TRACE_ID, PARENT_ID, True, "a=1", "k=v")
    with CallTrace(ctx):
        await _add(runtime, "traced")
    await _add(runtime, "plain")
    traced = [c.inv for c in fake.calls if c.container == "traced"]
    assert [inv.trace for inv in traced] == [ctx.environ()] * 2
    assert traced[0] is traced[1]  # one Invocation for the chain: its environment built once
    assert all(c.inv.trace == () for c in fake.calls if c.container == "plain")
    assert traced[0].environ()["TRACEPARENT"] == TP


async def test_a_task_the_call_left_behind_carries_no_trace() -> None:
    seen: list[object] = []
    release = asyncio.Event()

    async def later() -> None:
        await release.wait()
        seen.append(current())

    with CallTrace(TraceContext(TRACE_ID, PARENT_ID)) as call:
        assert current() is call
        task = asyncio.create_task(later())  # inherits the context, as a deferred CHECK does
    release.set()
    await task
    assert seen == [None] and current() is None


def test_log_lines_of_a_traced_call_carry_its_trace_id() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    ContextFields().filter(record)
    assert not hasattr(record, "TRACE_ID")
    with CallTrace(TraceContext(TRACE_ID, PARENT_ID)):
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
        ContextFields().filter(record)
    assert record.TRACE_ID == TRACE_ID


def test_the_agents_environment_never_gives_plugins_a_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEPARENT", TP)
    monkeypatch.setenv("BAGGAGE", "k=v")
    env = ProcessExecutor()._environ(Invocation("ADD"))
    assert b"TRACEPARENT" not in env and b"BAGGAGE" not in env
    traced = ProcessExecutor()._environ(Invocation("ADD", trace=(("TRACEPARENT", TP),)))
    assert traced[b"TRACEPARENT"] == TP.encode()


def test_off_a_call_without_a_context_is_not_traced_and_the_sdk_is_never_imported(
        tmp_path: Path) -> None:
    off = Tracing()
    with off.call("Setup", None) as scope:
        assert current() is None and not isinstance(scope, CallTrace)
    code = ("import sys; from cni_agent.config import AgentConfig; "
            "from cni_agent.service.wiring import build_core; "
            "import cni_agent.service.daemon; build_core(AgentConfig(state_dir=sys.argv[1], "
            "runtime_dir=sys.argv[1])); "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'google'))))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- the key, and config check without the SDK ------------------------------------------

BLOCK_OTEL = '''
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
'''


@pytest.mark.parametrize("value", ["localhost:4318", "ftp://x/", "http://", "http://a b:1/",
                                   "http://h:4318/?q=1", 4318])
def test_the_endpoint_must_be_an_http_url(value: object) -> None:
    from cni_agent.config import ConfigFileError, parse_config
    with pytest.raises(ConfigFileError, match=r"^f: tracing\.otlp_endpoint: "):
        parse_config({"tracing": {"otlp_endpoint": value}}, "f")


def test_the_endpoint_gets_the_traces_path_when_it_has_none() -> None:
    from cni_agent.config import parse_config
    def url(text: str) -> str:
        return parse_config({"tracing": {"otlp_endpoint": text}}, "f").tracing.traces_url()
    assert url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert url("https://otel.example:4318/") == "https://otel.example:4318/v1/traces"
    assert url("http://gw/otlp/v1/traces") == "http://gw/otlp/v1/traces"


def test_config_check_warns_without_the_sdk_and_stays_clean(tmp_path: Path) -> None:
    import os

    import yaml
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK_OTEL)
    (tmp_path / "net.d").mkdir()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"conf_dir": str(tmp_path / "net.d"), "fallback_network": True,
                                   "tracing": {"otlp_endpoint": "http://127.0.0.1:4318"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBUS_")}

    def check(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cni_agent", "config", "check", "--config",
                               str(cfg)], capture_output=True, text=True, timeout=60,
                              env={**env, **extra})

    # Before the interpreter's own path: an RPM's %check finds the package through it.
    site = os.pathsep.join(filter(None, [str(tmp_path / "site"), env.get("PYTHONPATH")]))
    without = check({"PYTHONPATH": site})
    assert without.returncode == 0, without.stdout + without.stderr
    warning, ok = without.stdout.splitlines()
    assert warning.startswith(f"{cfg}: warning: tracing.otlp_endpoint is set, but the "
                              "OpenTelemetry SDK is not installed"), warning
    assert ok.startswith("ok: ")
    # Where this interpreter has the SDK (the venv; not an RPM's %check on a
    # machine without it), the warning goes.
    with_sdk = check({})
    assert with_sdk.returncode == 0, with_sdk.stdout + with_sdk.stderr
    have_sdk = all(importlib.util.find_spec(m) for m in ("opentelemetry", "opentelemetry.sdk"))
    assert with_sdk.stdout.splitlines()[0] == (ok if have_sdk else warning), with_sdk.stdout


def test_under_journald_the_trace_id_is_a_journal_field() -> None:
    """What `journalctl TRACE_ID=…` matches: the record attribute becomes the
    journal field, through systemd-python's JournalHandler as the daemon sets it up."""
    journal = pytest.importorskip("systemd.journal")
    sent: list[dict[str, object]] = []

    def send(MESSAGE: str, **fields: object) -> None:  # journal.send's own name
        sent.append(fields)

    handler = journal.JournalHandler(sender_function=send, SYSLOG_IDENTIFIER="cni-agent")
    handler.addFilter(ContextFields())
    logger = logging.getLogger("cni_agent.test_tracectx")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with CallTrace(TraceContext(TRACE_ID, PARENT_ID)):
            logger.info("inside")
        logger.info("outside")
    finally:
        logger.removeHandler(handler)
    assert sent[0]["TRACE_ID"] == TRACE_ID and "TRACE_ID" not in sent[1]


def test_with_the_sdk_disabled_plugins_never_get_a_zero_id(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from cni_agent.service.otlp import Exporter
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    tracing = Tracing(Exporter("http://127.0.0.1:9/v1/traces"))
    inv = Invocation("ADD", "c", "/n", "eth0")
    ctx = TraceContext(TRACE_ID, PARENT_ID)
    with tracing.call("Setup", ctx) as call:
        assert isinstance(call, CallTrace)
        with call.plugin(inv, "bridge", "pods") as traced:
            assert dict(traced.trace)["TRACEPARENT"] == TP
    with tracing.call("Setup", None) as scope:
        assert current() is None and not isinstance(scope, CallTrace)
