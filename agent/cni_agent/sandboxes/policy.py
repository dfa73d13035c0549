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
  allowed (`access.capabilities`, default none; host ports never below 1024),
  holding at most `access.max_sandboxes` sandboxes, and only on networks
  whose attachments get anti-spoofing filters unless the admin lists them in
  `access.unprotected_networks` (`spoofing`);
- node-wide state (Reload, pod CIDRs) is root's (or polkit's `configure`,
  which the package's rule never grants to the group);
- anyone may read: properties, WaitReady, the shim's STATUS and VERSION.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.args import MAX_CONTAINER_ID
from cni_agent.cni.errors import InvalidArgument


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
    "WaitReady": Scope.OPEN,
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
LOWEST_MEMBER_PORT = 1024


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
    # Opened networks the agent cannot filter spoofing on that members may use anyway.
    unprotected_networks: frozenset[str] = frozenset()

    @classmethod
    def of(cls, networks: Iterable[str] = (), capabilities: Iterable[str] = (),
           max_sandboxes: int = 16, *, unprotected_networks: Iterable[str] = ()) -> Policy:
        return cls(frozenset(networks), frozenset(capabilities), max_sandboxes,
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
        if Policy.owns(caller, owner):
            return
        if owner is None and cached and sandbox_id.startswith(Policy.own_prefix(caller)):
            return
        raise not_yours(sandbox_id, caller)

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
        CNI_ARGS key that does the same (`ARG_CAPABILITIES`); host ports never
        below 1024."""
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
        for port, proto in host_ports(caps):
            if port < LOWEST_MEMBER_PORT:
                raise denied(f"host port {port}/{proto} is below {LOWEST_MEMBER_PORT}: only root "
                             "may map it")

    def quota(self, caller: Caller, held: int) -> None:
        if caller.root or held < self.max_sandboxes:
            return
        raise AgentError(ErrorKind.BUSY, f"uid {caller.uid} holds {held} sandbox(es), the most "
                                         f"access.max_sandboxes allows ({self.max_sandboxes})")


# CNI_ARGS keys the reference plugins read as the capability does (host-local
# and static take `IP`, bridge, tuning and static `MAC`): the same lever under
# another name.
ARG_CAPABILITIES = {"IP": "ips", "MAC": "mac"}


def host_ports(caps: Mapping[str, Any]) -> set[tuple[int, str]]:
    """(port, protocol) of each `portMappings` entry; InvalidArgument when malformed."""
    entries = caps.get("portMappings")
    if entries is None:
        return set()
    if not isinstance(entries, list):
        raise InvalidArgument("capabilities", "portMappings must be a list")
    out: set[tuple[int, str]] = set()
    for entry in entries:
        if not isinstance(entry, Mapping):
            raise InvalidArgument("capabilities", "each portMappings entry must be an object")
        port, proto = entry.get("hostPort"), entry.get("protocol", "tcp")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise InvalidArgument("capabilities", f"portMappings hostPort {port!r} is not a port")
        if not isinstance(proto, str):
            raise InvalidArgument("capabilities", f"portMappings protocol {proto!r} is not a string")
        out.add((port, proto.lower() or "tcp"))
    return out
