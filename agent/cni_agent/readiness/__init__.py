"""Readiness: the STATUS monitor and its verdicts, the node's pod CIDRs, the fallback network.
Decides NetworkReady and the default network; tells listeners, never the bus itself.
May import: `cni`, `node`, `api`, `config`; never `sandboxes`, `service` or `cli`.
"""
