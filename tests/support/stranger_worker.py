"""A D-Bus caller that hostile tests and the bench run as another user.

Run as `/usr/bin/python3 -I -c SOURCE ADDRESS` (tests/support/stranger.py
does, with a readable copy of the tests' own dbus-fast first on sys.path):
the stdlib otherwise, since another user may not be able to read the
checkout. One JSON request a line on stdin, one JSON answer a line on stdout:

  {"op": "send", "spec": SPEC}     -> {"outcome": ..., "error": ..., "text": ..., "seconds": ...}
  {"op": "own", "name": NAME}      -> {"outcome": ..., "reply": [code]}  (RequestName)
  {"op": "flood", "conns": N, "specs": [SPEC...], "timeout": S}
        -> {"ready": N} once connected; SPECs are then sent round and round on
           N connections (one call in flight each) until the next stdin line,
           then -> {"counts": {label: {outcome: n}}, "seconds": S}

SPEC: {"kind": "call" | "signal", "dest": bus name, "unique" (the agent's
unique name) or null (a broadcast), "path", "interface" (null: none),
"member", "signature", "body": JSON values as the signature says (below),
"fds": ["null" | "pipe" | "/a/path", ...] (opened here, one descriptor each,
closed once the message is sent), "flags": MessageFlag bits, "timeout",
"label"}.

Values: s/o/g strings, integers, booleans, d floats (NaN and infinities as
Python's json writes them), ay a list of byte values, a{..} a list of
[key, value] pairs, structs lists, v [signature, value]. Anywhere,
{"rep": [item, n]} is item repeated n times (a string, a byte of ay, an
array's element): huge values without huge pipes.

Outcomes: "return", "error" (with the error name and its text, cut),
"sent" (no reply expected), "timeout" (none came in time), "broken" (the
connection failed: the bus dropped us; we reconnect), "unsendable" (not a
message dbus-fast would marshal; nothing was sent).
"""

import asyncio
import json
import os
import sys
import time

from dbus_fast import Message, MessageFlag, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.signature import SignatureTree

AGENT = "org.cniagent.Agent1"
PATH = "/org/cniagent/Agent1"


def value(t, v):
    """The dbus-fast value of JSON `v` for SignatureType `t`."""
    tok = t.token
    rep = v.get("rep") if isinstance(v, dict) else None
    if tok in "sog":
        return rep[0] * rep[1] if rep else v
    if tok == "b":
        return bool(v)
    if tok == "d":
        return float(v)
    if tok in "ynqiuxth":
        return int(v)
    if tok == "v":
        sig, inner = v
        return Variant(sig, value(SignatureTree(sig).types[0], inner))
    if tok == "(":
        return [value(c, x) for c, x in zip(t.children, v, strict=True)]
    child = t.children[0]  # an array
    if child.token == "y":
        return bytes([rep[0]]) * rep[1] if rep else bytes(v)
    if rep:
        one = value(child, rep[0])
        return [one] * rep[1]
    if child.token == "{":
        return {value(child.children[0], k): value(child.children[1], x) for k, x in v}
    return [value(child, x) for x in v]


def open_fds(kinds):
    fds, extra = [], []
    try:
        for kind in kinds:
            if kind == "pipe":
                r, w = os.pipe()
                fds.append(r)
                extra.append(w)
            elif kind == "null":
                fds.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            else:
                fds.append(os.open(kind, os.O_RDONLY | os.O_CLOEXEC))
    except BaseException:
        close(fds + extra)
        raise
    return fds, extra


def close(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Caller:
    def __init__(self, address):
        self.address = address
        self.bus = None
        self.unique = ""

    async def connect(self):
        if self.bus is None or not self.bus.connected:
            self.bus = await MessageBus(bus_address=self.address, negotiate_unix_fd=True).connect()
            self.unique = ""
        return self.bus

    async def agent_unique(self):
        if not self.unique:
            reply = await self.bus.call(Message(
                destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus", member="GetNameOwner", signature="s",
                body=[AGENT]))
            self.unique = reply.body[0] if reply.message_type is MessageType.METHOD_RETURN else AGENT
        return self.unique

    async def send(self, spec):
        t0 = time.monotonic()
        try:
            bus = await self.connect()
        except Exception as e:
            return {"outcome": "broken", "text": f"connect: {e!r}"[:300]}
        dest = spec.get("dest", AGENT)
        if dest == "unique":
            dest = await self.agent_unique()
        signal = spec.get("kind") == "signal"
        try:
            tree = SignatureTree(spec.get("signature", ""))
            body = [value(t, v) for t, v in zip(tree.types, spec.get("body", []), strict=True)]
        except Exception as e:
            return {"outcome": "unsendable", "text": repr(e)[:300]}
        fds, extra = open_fds(spec.get("fds", []))
        try:
            try:
                msg = Message(destination=dest, path=spec.get("path", PATH),
                              interface=spec.get("interface", AGENT), member=spec["member"],
                              message_type=MessageType.SIGNAL if signal else MessageType.METHOD_CALL,
                              flags=MessageFlag(spec.get("flags", 0)), signature=tree.signature,
                              body=body, unix_fds=fds)
                msg._marshall(True)  # what cannot be marshalled is ours, not the bus's
            except Exception as e:
                return {"outcome": "unsendable", "text": repr(e)[:300]}
            expects_reply = not signal and not msg.flags & MessageFlag.NO_REPLY_EXPECTED
            try:
                if expects_reply:
                    reply = await asyncio.wait_for(bus.call(msg), spec.get("timeout", 30))
                else:  # sent: then the descriptors may be closed
                    reply = await asyncio.wait_for(bus.send(msg), spec.get("timeout", 30))
            except TimeoutError:
                return {"outcome": "timeout", "seconds": time.monotonic() - t0}
            except Exception as e:
                self.bus = None
                return {"outcome": "broken", "text": repr(e)[:300]}
        finally:
            close(fds + extra)
        out = {"seconds": time.monotonic() - t0}
        if reply is None:
            out["outcome"] = "sent"
        elif reply.message_type is MessageType.ERROR:
            text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
            out.update(outcome="error", error=reply.error_name, text=text[:300])
        else:
            out.update(outcome="return", signature=reply.signature,
                       size=len(json.dumps(reply.body, default=repr)))
        return out

    async def own(self, name):
        bus = await self.connect()
        reply = await bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="RequestName", signature="su", body=[name, 4]))
        return {"outcome": "return" if reply.message_type is MessageType.METHOD_RETURN else "error",
                "reply": reply.body}


async def flood(address, req, stop):
    """req["conns"] connections, each sending req["specs"] round and round until `stop`."""
    counts = {}
    callers = [Caller(address) for _ in range(req["conns"])]
    for c in callers:
        await c.connect()
        await c.agent_unique()
    write({"ready": len(callers)})

    async def loop(caller, offset):
        specs = req["specs"]
        i = offset
        while not stop.is_set():
            spec = specs[i % len(specs)]
            i += 1
            res = await caller.send(spec)
            key = res["outcome"] if res["outcome"] != "error" else res["error"]
            per = counts.setdefault(spec.get("label", spec["member"]), {})
            per[key] = per.get(key, 0) + 1

    t0 = time.monotonic()
    tasks = [asyncio.ensure_future(loop(c, i)) for i, c in enumerate(callers)]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in callers:
        if c.bus is not None:
            c.bus.disconnect()
    return {"counts": counts, "seconds": time.monotonic() - t0}


def write(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(address):
    loop = asyncio.get_running_loop()
    caller = Caller(address)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        req = json.loads(line)
        if req["op"] == "send":
            write(await caller.send(req["spec"]))
        elif req["op"] == "own":
            write(await caller.own(req["name"]))
        elif req["op"] == "flood":
            stop = asyncio.Event()
            waiter = loop.run_in_executor(None, sys.stdin.readline)
            waiter.add_done_callback(lambda _, stop=stop: stop.set())
            write(await flood(address, req, stop))
            return


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
