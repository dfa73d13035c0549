"""The CNI runtime: network configs, plugin execution, ADD/DEL/CHECK/STATUS/GC chains, result cache.
Knows nothing of D-Bus, systemd or sandboxes; everything above it is an adapter or a user.
May import: nothing of the agent outside `cni`.
"""
