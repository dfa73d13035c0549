"""Who may do what: the one place every "may this caller …" is answered.

Every entry point (the D-Bus methods, the shim's calls, Setup and Teardown,
Attach and Detach, Check, Show, GC, the CHECK passes asked for) asks here,
from the caller's credentials and the object; nothing else decides. The
anchors are LXC's `lxc-user-nic` and QEMU's `qemu-bridge-helper`: root
helpers that let unprivileged users attach to networks the admin chose. Both
had holes where "may" was answered in several places (CVE-2017-5985,
CVE-2026-39402); this module is stricter than both:

- root may do everything, on every sandbox, and name namespaces by path;
- any other caller (a member of `access.groups`, or whom polkit authorized)
  reaches only its own sandboxes, in its own id space (`qualify`), only in a
  network namespace its uid owns through every user namespace up to the
  node's (`netns`: a readable descriptor proves nothing, nsfs files are
  world-readable), only on the networks the admin opened to it
  (`access.networks`, default none), passing only the capabilities the admin
  allowed (`access.capabilities`, default none), host ports only inside
  `access.host_ports` (default none) and CNI_ARGS keys only in
  `access.cni_args` (default none besides `IgnoreUnknown`: no Kubernetes
  identity), holding at most `access.max_sandboxes` sandboxes and
  `access.max_attachments` attachments, each network at most once per
  sandbox (`attachments`), and all such callers together at most
  `access.members_share` of a network's addresses where its config gives
  the pool size (`addresses`): the rest is root's reserve; and only on
  networks whose attachments get anti-spoofing filters unless the admin
  lists them in `access.unprotected_networks` (`spoofing`);
- no caller, root included, maps a host port another sandbox maps (`HostPort`:
  hostIP, protocol and port, normalized before any comparison);
- node-wide state (Reload, pod CIDRs) is root's (or polkit's `configure`,
  which the package's rule never grants to the group);
- anyone may read: properties, WaitReady, NetworkCapacity (how full each
  pool is: counts, never whose), the shim's STATUS and VERSION.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.args import MAX_CONTAINER_ID, PodMeta, pod_args
from cni_agent.cni.errors import InvalidArgument
from cni_agent.cni.pool import Pool


class Role(StrEnum):
    ROOT = "root"
    MEMBER = "member"  # in access.groups
    DELEGATE = "delegate"  # neither, but polkit authorized this call
    STRANGER = "stranger"  # anyone else: reads only, bounded


@dataclass(frozen=True)
class Caller:
    uid: int
    role: Role

    @property
    def root(self) -> bool:
        return self.role is Role.ROOT

    @property
    def privileged(self) -> bool:
        """Root or a member: the callers whose load is not bounded per uid and
        whose calls a shutdown's drain waits for."""
        return self.role in (Role.ROOT, Role.MEMBER)


ROOT = Caller(0, Role.ROOT)


class Scope(Enum):
    """What a method needs, declared once per method in METHODS."""

    OPEN = "open"  # anyone (bounded per uid when neither root nor a member)
    INSPECT = "inspect"  # root, members, polkit org.cniagent.Agent1.inspect
    MANAGE = "manage"  # root, members, polkit org.cniagent.Agent1.manage
    NODE = "node"  # root, polkit org.cniagent.Agent1.configure (never the group's by default)
    RUNTIME = "runtime"  # root alone: a runtime's CNI call names its namespace by path


# Every D-Bus method, with what it needs. CNICall's scope depends on its
# command (`cnicall_scope`).
METHODS: Mapping[str, Scope] = {
    "Setup": Scope.MANAGE, "Teardown": Scope.MANAGE, "Attach": Scope.MANAGE,
    "Detach": Scope.MANAGE, "GarbageCollect": Scope.MANAGE, "CheckSandboxes": Scope.MANAGE,
    "Check": Scope.INSPECT, "Show": Scope.INSPECT, "ListSandboxes": Scope.INSPECT,
    "Reload": Scope.NODE, "SetPodCIDRs": Scope.NODE, "ResetPodCIDRs": Scope.NODE,
    "WaitReady": Scope.OPEN, "NetworkCapacity": Scope.OPEN, "WatchSandboxes": Scope.INSPECT,
}
READ_ONLY_COMMANDS = frozenset({"STATUS", "VERSION"})

# polkit's action for each scope it may grant (OPEN needs none, RUNTIME none can).
ACTIONS: Mapping[Scope, str] = {
    Scope.INSPECT: "org.cniagent.Agent1.inspect",
    Scope.MANAGE: "org.cniagent.Agent1.manage",
    Scope.NODE: "org.cniagent.Agent1.configure",
}

# A non-root caller's sandbox `ID` is `cni-agent.u<UID>.ID` on disk, in locks,
# in the cache and to plugins (CNI_CONTAINERID must be unique on the node:
# host-local keys allocations by it). So a member can never take, block or
# probe an id of root's or of another uid; root sees and manages members'
# sandboxes by these names, and may not create one itself.
OWNED_PREFIX = "cni-agent.u"

# Capabilities that reach host-wide state, the ones a member must be given
# explicitly (every other capability too: the allowed list is the whole list).
HOST_WIDE_CAPABILITIES = ("portMappings", "ips", "mac", "ipRanges", "infinibandGUID", "deviceID")


def cnicall_scope(command: str) -> Scope:
    return Scope.OPEN if command in READ_ONLY_COMMANDS else Scope.RUNTIME


def denied(what: str) -> AgentError:
    return AgentError(ErrorKind.ACCESS_DENIED, what)


def not_yours(sandbox_id: str, caller: Caller) -> AgentError:
    """The same words whether the sandbox is another's or does not exist (the
    id as the caller gave it)."""
    return denied(f"sandbox {Policy.shown(caller, sandbox_id)} is not one of uid {caller.uid}'s "
                  "sandboxes")


@dataclass(frozen=True)
class Policy:
    """`access.*`: what the admin opened to callers that are not root."""

    open_networks: frozenset[str] = frozenset()
    open_capabilities: frozenset[str] = frozenset()
    max_sandboxes: int = 16
    max_attachments: int = 16
    members_share: float = 0.5
    # `access.host_ports`, parsed: (first, last) of each range.
    open_host_ports: tuple[tuple[int, int], ...] = ()
    # `access.cni_args`: CNI_ARGS keys besides IgnoreUnknown (and IP/MAC, the capabilities').
    open_cni_args: frozenset[str] = frozenset()
    # Opened networks the agent cannot filter spoofing on that members may use anyway.
    unprotected_networks: frozenset[str] = frozenset()

    @classmethod
    def of(cls, networks: Iterable[str] = (), capabilities: Iterable[str] = (),
           max_sandboxes: int = 16, *, max_attachments: int = 16, members_share: float = 0.5,
           host_ports: Iterable[tuple[int, int]] = (), cni_args: Iterable[str] = (),
           unprotected_networks: Iterable[str] = ()) -> Policy:
        return cls(frozenset(networks), frozenset(capabilities), max_sandboxes,
                   max_attachments=max_attachments, members_share=members_share,
                   open_host_ports=tuple(host_ports), open_cni_args=frozenset(cni_args),
                   unprotected_networks=frozenset(unprotected_networks))

    # --- methods ---------------------------------------------------------------------

    @staticmethod
    def permits(caller: Caller, scope: Scope) -> bool:
        """Whether `caller` may call a method of `scope` without asking polkit."""
        if caller.root or scope is Scope.OPEN:
            return True
        if scope in (Scope.INSPECT, Scope.MANAGE):
            return caller.role in (Role.MEMBER, Role.DELEGATE)
        return False  # NODE: root, or polkit's configure; RUNTIME: root alone

    @staticmethod
    def refusal(caller: Caller, method: str, scope: Scope, groups: Collection[str]) -> str:
        """Why `caller` may not call `method` (before any polkit answer is added)."""
        if scope is Scope.RUNTIME:
            return (f"{method} is for runtimes running as root; use Setup or Attach with "
                    "netns_fd")
        if scope is Scope.NODE:
            return f"{method} changes the whole node: root's (caller uid {caller.uid})"
        names = " or ".join(groups) or "(none configured)"
        return f"{method} requires root or membership in the {names} group (caller uid {caller.uid})"

    # --- ids ------------------------------------------------------------------------------

    @staticmethod
    def qualify(caller: Caller, sandbox_id: str, field: str = "sandbox_id") -> str:
        """The sandbox id `caller` means by `sandbox_id` (already validated):
        root's as given, another caller's in its own id space."""
        if caller.root:
            return sandbox_id
        owned = f"{OWNED_PREFIX}{caller.uid}.{sandbox_id}"
        if len(owned) > MAX_CONTAINER_ID:
            raise InvalidArgument(field, f"longer than {MAX_CONTAINER_ID - len(owned) + len(sandbox_id)} "
                                         "characters (a non-root caller's ids carry its uid)")
        return owned

    @staticmethod
    def shown(caller: Caller, sandbox_id: str) -> str:
        """The id as `caller` knows it (the inverse of `qualify`)."""
        if caller.root:
            return sandbox_id
        prefix = f"{OWNED_PREFIX}{caller.uid}."
        return sandbox_id[len(prefix):] if sandbox_id.startswith(prefix) else sandbox_id

    @staticmethod
    def own_prefix(caller: Caller) -> str:
        """The file-name prefix of `caller`'s sandboxes ("" for root: all)."""
        return "" if caller.root else f"{OWNED_PREFIX}{caller.uid}."

    @staticmethod
    def check_new_id(sandbox_id: str, field: str = "sandbox_id") -> None:
        """A sandbox root creates (Setup, Attach, a runtime's ADD) keeps out of
        the members' id space, so it can never take or block one of theirs."""
        if sandbox_id.startswith(OWNED_PREFIX):
            raise InvalidArgument(field, f"ids beginning {OWNED_PREFIX!r} name sandboxes of "
                                         "callers that are not root; choose another id")

    # --- objects ----------------------------------------------------------------------------

    @staticmethod
    def sandbox(caller: Caller, sandbox_id: str, owner: int | None, foreign: bool = False
                ) -> None:
        """May `caller` act on this sandbox: root always; another caller on its
        own record (`owner`), or on an id nothing holds yet (`owner` None and no
        `foreign` cache entries: another tool's, which are root's)."""
        if caller.root:
            return
        if owner is None and not foreign:
            return
        Policy.holds(caller, sandbox_id, owner)

    @staticmethod
    def owns(caller: Caller, owner: int | None) -> bool:
        """Whether a sandbox recorded as `owner`'s (None: no record) is one
        `caller` reaches: root's reach is every sandbox, another's its own."""
        return caller.root or owner == caller.uid

    @staticmethod
    def holds(caller: Caller, sandbox_id: str, owner: int | None, cached: bool = False) -> None:
        """May `caller` act on this existing sandbox (`owner` None: it has no
        record, or none at all): root always; another caller on its own only.
        A record set aside as damaged (a power cut) leaves only `cached`
        entries: an id in the caller's own space is its all the same, since
        root creates none there — or its Teardown could never free them."""
        if not Policy.may_show(caller, sandbox_id, owner, cached):
            raise not_yours(sandbox_id, caller)

    @staticmethod
    def may_show(caller: Caller, sandbox_id: str, owner: int | None, cached: bool = False
                 ) -> bool:
        """`holds` as a question: whether `caller` may see (Show) this sandbox —
        and so be told of its changes (WatchSandboxes, the check signals)."""
        if Policy.owns(caller, owner):
            return True
        return owner is None and cached and sandbox_id.startswith(Policy.own_prefix(caller))

    @staticmethod
    def named_by_path(caller: Caller) -> None:
        """Only root's namespaces may be named by a path the agent opens."""
        if not caller.root:
            raise denied("only root may name a namespace by path: open it yourself and pass the "
                         "descriptor as option netns_fd (D-Bus type h)")

    @staticmethod
    def netns(caller: Caller, owners: tuple[int, ...] | None) -> None:
        """A non-root caller's namespace must be one its uid is privileged over:
        every user namespace from the one owning it up to the node's is owned
        by the caller's uid (`owners`: their owner uids, innermost first; ()
        when the node's own user namespace owns it; None when unknown).

        Refused with no word about the namespace: what a caller may not
        configure it need not learn about either."""
        if caller.root:
            return
        if not owners or any(uid != caller.uid for uid in owners):
            raise denied(f"uid {caller.uid} may only configure a network namespace of a user "
                         "namespace it owns (for example one made with unshare -U -r -n)")

    def network(self, caller: Caller, name: str) -> None:
        if caller.root or name in self.open_networks:
            return
        opened = ", ".join(sorted(self.open_networks)) or "none"
        raise denied(f"network {name} is not open to callers that are not root (access.networks: "
                     f"{opened})")

    def spoofing(self, caller: Caller, name: str, unprotected: str) -> None:
        """A network whose attachments would go without anti-spoofing filters
        (`unprotected` says why; "" when they get them) reaches callers that
        are not root only when the admin lists it in access.unprotected_networks:
        on it, a member's pod can claim another pod's MAC and addresses."""
        if caller.root or not unprotected or name in self.unprotected_networks:
            return
        raise denied(f"network {name} cannot be protected against address spoofing here "
                     f"({unprotected}); callers that are not root may use it only if "
                     "access.unprotected_networks lists it")

    def capabilities(self, caller: Caller, caps: Mapping[str, Any],
                     args: Iterable[tuple[str, str]] = ()) -> None:
        """Only the capabilities the admin allowed, by name or through the
        CNI_ARGS key that does the same (`ARG_CAPABILITIES`); host ports only
        inside `access.host_ports`. Everyone's port mappings are read (and
        InvalidArgument when malformed) first: root's are compared too."""
        ports = port_mappings(caps)
        if caller.root:
            return
        allowed = ", ".join(sorted(self.open_capabilities)) or "none"
        for key in caps:
            if key not in self.open_capabilities:
                raise denied(f"capability {key!r} is not allowed to callers that are not root "
                             f"(access.capabilities: {allowed})")
        for key, _ in args:
            cap = ARG_CAPABILITIES.get(key.upper())
            if cap is not None and cap not in self.open_capabilities:
                raise denied(f"argument {key} sets what capability {cap!r} sets, which is not "
                             f"allowed to callers that are not root (access.capabilities: "
                             f"{allowed})")
        for port in sorted(ports):
            if not any(first <= port.port <= last for first, last in self.open_host_ports):
                granted = ", ".join(format_port_range(r) for r in self.open_host_ports) or "none"
                raise denied(f"host port {port.port}/{port.protocol} is not in a range open to "
                             f"callers that are not root (access.host_ports: {granted})")

    def arguments(self, caller: Caller, args: Iterable[tuple[str, str]],
                  pod: PodMeta | None = None) -> None:
        """The CNI_ARGS keys a caller that is not root may pass: `IgnoreUnknown`,
        `IP` and `MAC` (their capabilities decide, `capabilities`), and those
        `access.cni_args` lists. Kubernetes' identity (`K8S_*`, and the `pod`
        option that adds it) is a key like any other: plugins key policy and
        IPAM on it, so only where the admin listed it."""
        if caller.root:
            return
        listed = ", ".join(sorted(self.open_cni_args)) or "none"
        if pod is not None:
            for key, _ in pod_args(pod, ""):
                if key != IGNORE_UNKNOWN and key not in self.open_cni_args:
                    raise denied(f"option pod passes argument {key}, which is not allowed to "
                                 f"callers that are not root (access.cni_args: {listed})")
        for key, _ in args:
            if key == IGNORE_UNKNOWN or key.upper() in ARG_CAPABILITIES or key in self.open_cni_args:
                continue
            raise denied(f"argument {key} is not allowed to callers that are not root "
                         f"(access.cni_args: {listed})")

    @staticmethod
    def port_taken(caller: Caller, wanted: HostPort, held: HostPort, holder: str) -> InvalidArgument:
        """A mapping another sandbox holds: not a question of access (root gets
        it too), so InvalidArgument, the same for every caller. Only root
        learns which sandbox holds it."""
        who = f"sandbox {holder}" if caller.root else "another sandbox"
        as_ = "" if held == wanted else f" as {held}"
        return InvalidArgument("capabilities", f"host port {wanted} is already mapped by "
                                               f"{who}{as_}")

    def quota(self, caller: Caller, held: int) -> None:
        if caller.root or held < self.max_sandboxes:
            return
        raise AgentError(ErrorKind.BUSY, f"uid {caller.uid} holds {held} sandbox(es), the most "
                                         f"access.max_sandboxes allows ({self.max_sandboxes})")

    # --- attachments and addresses (issue 44) -------------------------------------------

    @staticmethod
    def once_per_sandbox(caller: Caller, sandbox_id: str, networks: Sequence[str],
                         field: str = "networks") -> None:
        """A non-root caller's sandbox has each network at most once (`networks`:
        what it has and what the call adds): a second interface on a network
        is a second address of its pool, which the quotas must not be the only
        bound on. Root keeps whatever it asks for."""
        if caller.root:
            return
        seen: set[str] = set()
        for name in networks:
            if name in seen:
                raise InvalidArgument(field, f"network {name} twice in sandbox "
                                             f"{Policy.shown(caller, sandbox_id)}: callers that are "
                                             "not root attach a sandbox to each network once")
            seen.add(name)

    def attachments(self, caller: Caller, held: int, adding: int) -> None:
        """`access.max_attachments`: what one non-root uid holds across all its
        sandboxes (`held`, calls under way included) once this call's `adding` are in."""
        if caller.root or held + adding <= self.max_attachments:
            return
        raise AgentError(ErrorKind.BUSY, f"uid {caller.uid} holds {held} attachment(s); {adding} "
                                         "more would pass the most access.max_attachments allows "
                                         f"({self.max_attachments})")

    def addresses(self, caller: Caller, network: str, pool: Pool | None, held: int,
                  adding: int) -> None:
        """`access.members_share`: all non-root callers together (`held`
        attachments on `network`, calls under way included) keep to that share
        of each of its range sets, so the rest is root's; no limit where the
        pool size is unknown (`pool` None: the per-uid quotas alone apply)."""
        if caller.root or pool is None:
            return
        most = pool.share(self.members_share)
        if held + adding <= most:
            return
        raise AgentError(ErrorKind.BUSY, f"network {network}: callers that are not root hold "
                                         f"{held} of its {pool.size} addresses; the most "
                                         f"access.members_share ({self.members_share:g}) allows "
                                         f"them is {most}, the rest is kept for root")


# CNI_ARGS keys the reference plugins read as the capability does (host-local
# and static take `IP`, bridge, tuning and static `MAC`): the same lever under
# another name.
ARG_CAPABILITIES = {"IP": "ips", "MAC": "mac"}
# What libcni's plugins read to ignore keys they do not know: always allowed.
IGNORE_UNKNOWN = "IgnoreUnknown"

# A protocol as a port mapping may spell it (portmap hands it to iptables,
# which takes names in any case and numbers alike): the one name compared.
PROTOCOLS = {"tcp": "tcp", "6": "tcp", "udp": "udp", "17": "udp", "sctp": "sctp", "132": "sctp"}


@dataclass(frozen=True, order=True)
class HostPort:
    """What a port mapping takes on the host: the key two mappings conflict on."""

    port: int
    protocol: str  # normalized: tcp, udp or sctp
    host_ip: str = ""  # normalized; "" = every address (absent, empty, 0.0.0.0, ::)

    def conflicts(self, other: HostPort) -> bool:
        return (self.port == other.port and self.protocol == other.protocol
                and (not self.host_ip or not other.host_ip or self.host_ip == other.host_ip))

    def __str__(self) -> str:
        return f"{self.port}/{self.protocol}" + (f" on {self.host_ip}" if self.host_ip else "")


def normalize_protocol(value: object) -> str:
    """`tcp`, `udp` or `sctp` for any spelling of them; absent or "" is tcp
    (what kubelet fills in). InvalidArgument for anything else."""
    if value is None or value == "":
        return "tcp"
    if not isinstance(value, str):
        raise InvalidArgument("capabilities", f"portMappings protocol {value!r} is not a string")
    name = PROTOCOLS.get(value.lower())
    if name is None:
        raise InvalidArgument("capabilities", f"portMappings protocol {value[:40]!r} is not one "
                                              "of tcp, udp, sctp (or 6, 17, 132)")
    return name


def normalize_host_ip(value: object) -> str:
    """An address as compared: "" for every address (absent, "", 0.0.0.0, ::),
    an IPv4-mapped IPv6 address as the IPv4 one. InvalidArgument when not an address."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise InvalidArgument("capabilities", f"portMappings hostIP {value!r} is not a string")
    try:
        addr = ipaddress.ip_address(value)
    except ValueError:
        raise InvalidArgument("capabilities", f"portMappings hostIP {value[:60]!r} is not an IP "
                                              "address") from None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return "" if addr.is_unspecified else str(addr)


def host_port(entry: object) -> HostPort:
    """One `portMappings` entry's key; InvalidArgument when malformed."""
    if not isinstance(entry, Mapping):
        raise InvalidArgument("capabilities", "each portMappings entry must be an object")
    # Keys as portmap (Go's encoding/json) reads them, whatever their case:
    # containerd's go-cni sends "HostPort", "Protocol", "HostIP"; a later key wins.
    fields = {str(k).lower(): v for k, v in entry.items()}
    port = fields.get("hostport")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidArgument("capabilities", f"portMappings hostPort {port!r} is not a port")
    return HostPort(port, normalize_protocol(fields.get("protocol")),
                    normalize_host_ip(fields.get("hostip")))


def port_mappings(caps: Mapping[str, Any]) -> frozenset[HostPort]:
    """The host ports a call's `portMappings` takes; InvalidArgument when malformed."""
    entries = caps.get("portMappings")
    if entries is None:
        return frozenset()
    if not isinstance(entries, list):
        raise InvalidArgument("capabilities", "portMappings must be a list")
    return frozenset(host_port(entry) for entry in entries)


def held_ports(caps: Mapping[str, Any]) -> frozenset[HostPort]:
    """The host ports a recorded attachment holds: each entry read on its own,
    a malformed one (recorded before entries were checked) holding nothing."""
    entries = caps.get("portMappings")
    out: set[HostPort] = set()
    for entry in entries if isinstance(entries, list) else ():
        try:
            out.add(host_port(entry))
        except InvalidArgument:
            continue
    return frozenset(out)


def first_conflict(wanted: Iterable[HostPort], held: Iterable[HostPort]
                   ) -> tuple[HostPort, HostPort] | None:
    """(wanted, held) of the lowest wanted port some held port conflicts with."""
    held = tuple(held)
    for port in sorted(wanted):
        for other in held:
            if port.conflicts(other):
                return port, other
    return None


def format_port_range(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"
