"""The `cni-agent` commands: another process, talking to the agent over D-Bus; and `shim-config`.
Owns argument parsing, output and the D-Bus client.
May import: `api`, `bus`, `cni` (argument checks); nothing of the daemon's side.
"""
