"""Validation of identifiers and construction of CNI_ARGS.

The spec's rules, plus length bounds so that a cache file name
`<network>-<containerID>-<ifname>` always fits in one path component.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cni_agent.cni.errors import InvalidArgument

_ID_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*")
# Keys reach plugins as `K=V;K2=V2`: anything that could start a new pair, or
# that a shell/log line would misread, is refused.
_ARG_KEY_RE = re.compile(r"[A-Za-z0-9_.\-]+")

MAX_CONTAINER_ID = 128
MAX_NETWORK_NAME = 100
MAX_IFNAME = 15
MAX_ARG_KEY = 128
MAX_ARG_VALUE = 4096
MAX_ARGS = 64


def _check_id(field: str, value: str, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(field, "must not be empty")
    if len(value) > limit:
        raise InvalidArgument(field, f"longer than {limit} characters")
    if not _ID_RE.fullmatch(value):
        raise InvalidArgument(
            field,
            f"{value!r} must start with a letter or digit and contain only "
            "letters, digits, '_', '.' and '-'",
        )
    return value


def validate_container_id(value: str, field: str = "sandbox_id") -> str:
    return _check_id(field, value, MAX_CONTAINER_ID)


def validate_network_name(value: str, field: str = "network") -> str:
    return _check_id(field, value, MAX_NETWORK_NAME)


def validate_ifname(value: str, field: str = "ifname") -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(field, "must not be empty")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_IFNAME:
        raise InvalidArgument(field, f"{value[:40]!r} is longer than {MAX_IFNAME} bytes")
    if value in (".", ".."):
        raise InvalidArgument(field, f"{value!r} is not a valid interface name")
    for ch in value:
        if ch in "/:" or ch.isspace() or not ch.isprintable() or ord(ch) > 0x7E:
            raise InvalidArgument(field, f"{value!r} contains {ch!r}, not allowed in an interface name")
    return value


def _check_arg(key: str, value: str) -> None:
    if not isinstance(key, str) or not isinstance(value, str):
        raise InvalidArgument("args", "keys and values must be strings")
    if len(key) > MAX_ARG_KEY or not _ARG_KEY_RE.fullmatch(key):
        raise InvalidArgument(
            "args", f"key {key[:40]!r} may contain only letters, digits, '_', '.' and '-'"
        )
    if len(value) > MAX_ARG_VALUE:
        raise InvalidArgument("args", f"value of {key} is longer than {MAX_ARG_VALUE} characters")
    if ";" in value or not value.isprintable():  # else no character to look at one by one
        for ch in value:
            if ch == ";" or not ch.isprintable():
                raise InvalidArgument(
                    "args", f"value of {key} contains {ch!r}, which would inject another argument"
                )


@dataclass(frozen=True)
class PodMeta:
    """Kubernetes pod metadata; only when given do K8S_* args appear."""

    namespace: str
    name: str
    uid: str = ""


def pod_args(pod: PodMeta, container_id: str) -> list[tuple[str, str]]:
    """The pairs the `pod` option adds, as kubelet's runtimes pass them."""
    k8s = [("IgnoreUnknown", "1"), ("K8S_POD_NAMESPACE", pod.namespace),
           ("K8S_POD_NAME", pod.name), ("K8S_POD_INFRA_CONTAINER_ID", container_id)]
    if pod.uid:
        k8s.append(("K8S_POD_UID", pod.uid))
    return k8s


def build_cni_args(
    args: Iterable[tuple[str, str]], pod: PodMeta | None, container_id: str
) -> list[tuple[str, str]]:
    """The caller's pairs as given, plus the Kubernetes ones only for pods."""
    pairs = list(args)
    if len(pairs) > MAX_ARGS:
        raise InvalidArgument("args", f"more than {MAX_ARGS} arguments")
    for k, v in pairs:
        _check_arg(k, v)
    if pod is not None:
        k8s = pod_args(pod, container_id)
        for k, v in k8s:
            try:
                _check_arg(k, v)
            except InvalidArgument as e:
                raise InvalidArgument("pod", e.reason) from None
        given = {k for k, _ in pairs}
        pairs = [kv for kv in k8s if kv[0] not in given] + pairs
    return pairs


def format_cni_args(pairs: Sequence[tuple[str, str]]) -> str:
    return ";".join([f"{k}={v}" for k, v in pairs])  # a list: one frame, not one per pair
