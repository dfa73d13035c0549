"""The CNI runtime: configuration, plugin execution, chains, result cache.

Knows nothing of D-Bus or systemd; everything above it is an adapter.
"""
