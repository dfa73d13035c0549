"""A CRI client, as kubelet is one: `runtime.v1.RuntimeService` over the
runtime's gRPC socket (grpcio for HTTP/2; the messages by wire.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import grpc

from tests.cri.wire import Message, encode, entries

SERVICE = "/runtime.v1.RuntimeService/"
PROTOCOLS = {"tcp": 0, "udp": 1, "sctp": 2}  # enum Protocol
SANDBOX_READY = 0  # enum PodSandboxState
NAMESPACE_CONTAINER = 1  # enum NamespaceMode


@dataclass
class PortMapping:
    container_port: int
    host_port: int
    protocol: str = "tcp"
    host_ip: str = ""

    def encode(self) -> bytes:  # message PortMapping
        return encode((1, PROTOCOLS[self.protocol]), (2, self.container_port), (3, self.host_port),
                      (4, self.host_ip))


@dataclass
class Pod:
    """What kubelet puts in a PodSandboxConfig, as much as networking reads."""

    name: str
    namespace: str = "default"
    uid: str = ""
    attempt: int = 0
    port_mappings: list[PortMapping] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    cgroup_parent: str = ""  # kubelet always sets one; the runtimes pass it as cgroupPath

    def encode(self) -> bytes:  # message PodSandboxConfig
        metadata = encode((1, self.name), (2, self.uid or f"uid-{self.name}"), (3, self.namespace),
                          (4, self.attempt))
        # As kubelet for a pod that does not share its process namespace:
        # NamespaceOption.pid = CONTAINER (CRI-O then runs no infra container).
        namespaces = encode((2, NAMESPACE_CONTAINER))  # message NamespaceOption
        security = encode((1, namespaces))  # message LinuxSandboxSecurityContext
        linux = encode((1, self.cgroup_parent), (2, security))  # message LinuxPodSandboxConfig
        return encode((1, metadata), (2, self.name),
                      *[(5, p.encode()) for p in self.port_mappings], *entries(6, self.labels),
                      *entries(7, self.annotations), (8, linux))


@dataclass
class SandboxStatus:
    id: str
    name: str
    ready: bool
    ip: str
    additional_ips: list[str]
    netns: str  # the network namespace's path, from the verbose info
    pid: int  # the sandbox's (pause) process, from the verbose info


class CRI:
    def __init__(self, socket: str) -> None:
        self.channel = grpc.insecure_channel(f"unix://{socket}")

    def close(self) -> None:
        self.channel.close()

    def call(self, method: str, request: bytes, timeout: float = 60) -> Message:
        # No serializers: grpcio passes the bytes through as they are.
        rpc = self.channel.unary_unary(SERVICE + method)
        reply = rpc(request, timeout=timeout, wait_for_ready=False)
        assert isinstance(reply, bytes)
        return Message.parse(reply)

    def version(self) -> tuple[str, str]:
        """(runtime name, runtime version)."""
        reply = self.call("Version", encode((1, "v1")))
        return reply.text(2), reply.text(3)

    def conditions(self) -> dict[str, tuple[bool, str]]:
        """Status: each RuntimeCondition's type → (status, reason: message)."""
        status = self.call("Status", b"").sub(1)
        return {c.text(1): (bool(c.uint(2)), f"{c.text(3)}: {c.text(4)}") for c in status.subs(1)}

    def network_ready(self) -> bool:
        return self.conditions()["NetworkReady"][0]

    def run(self, pod: Pod, handler: str = "", timeout: float = 120) -> str:
        """RunPodSandbox; the sandbox's id."""
        return self.call("RunPodSandbox", encode((1, pod.encode()), (2, handler)), timeout).text(1)

    def stop(self, sandbox: str) -> None:
        self.call("StopPodSandbox", encode((1, sandbox)))

    def remove(self, sandbox: str) -> None:
        self.call("RemovePodSandbox", encode((1, sandbox)))

    def status(self, sandbox: str) -> SandboxStatus:
        reply = self.call("PodSandboxStatus", encode((1, sandbox), (2, True)))
        status, info = reply.sub(1), reply.strmap(2)
        verbose = json.loads(info.get("info", "{}"))
        spec = verbose.get("runtimeSpec", {})
        netns = next((ns.get("path", "") for ns in spec.get("linux", {}).get("namespaces", [])
                      if ns.get("type") == "network"), "")
        network = status.sub(5)
        return SandboxStatus(status.text(1), status.sub(2).text(1), status.uint(3) == SANDBOX_READY,
                             network.text(1), [m.text(1) for m in network.subs(2)], netns,
                             int(verbose.get("pid", 0)))

    def sandboxes(self) -> list[str]:
        """ListPodSandbox: every sandbox's id, ready or not."""
        return [item.text(1) for item in self.call("ListPodSandbox", b"").subs(1)]
