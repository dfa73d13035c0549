"""The adapters: daemon wiring, D-Bus and the shim's CNICall, HTTP and metrics, sd_notify, auth, journald.
Thin: parse, authorize, call the layers below, map errors to the contract's names.
May import: every layer below; never `cli` (another process).
"""
