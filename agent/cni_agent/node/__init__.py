"""The node's primitives: network namespaces, locks, inotify, blocking work on caller paths.
Owns no policy: it says what is there and holds what is asked for.
May import: `cni` (its errors), `api`.
"""
