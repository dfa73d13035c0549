"""Basic auth for the HTTP face (`http.web_config`'s basic_auth_users): bcrypt,
with a short memory of credentials already verified.

bcrypt is slow on purpose (about 50 ms of CPU at cost 10): at one scrape
every 15 s from each of two Prometheus servers, checking every request would
spend a bcrypt per request forever. A credential that verified is remembered
for CACHE_SECONDS as an HMAC under a key made at start (never the password,
nor an unkeyed hash of it that a memory dump would let someone brute-force),
so a scrape costs one HMAC and one constant-time compare, and a bcrypt only
once a minute per user. A reload makes a new checker: a changed or removed
user is never served from the old memory.

Every bcrypt runs in a thread (the event loop also serves D-Bus), one at a
time, with a bounded queue: a flood of wrong passwords costs at most one
core, never the loop, and credentials already verified are served without
waiting behind it. An unknown user costs a bcrypt too (against a fixed hash),
so the answer's timing does not tell which users exist.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import os
import time
from collections.abc import Callable, Mapping

import bcrypt

CACHE_SECONDS = 60.0
# bcrypt reads at most 72 bytes of a password (newer bcrypt modules refuse
# longer ones instead of ignoring the rest, as the hashes' makers did).
_BCRYPT_MAX = 72
# Requests that may wait for the one bcrypt thread; beyond, refused at once.
_QUEUE = 32
# A valid hash of no one's password, for unknown users: cost 10 as htpasswd's.
_NOBODY = b"$2b$10$o4XBhpKiLwBD8k97EPVBfuGbo.Qj0lhdE55XDJ4k9ovpahF.dVRx2"


def credentials(header: str | None) -> tuple[str, bytes] | None:
    """(user, password) of an `Authorization: Basic ...` header, or None."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True)
        user, sep, password = decoded.partition(b":")
        return (user.decode("utf-8"), password) if sep else None
    except (binascii.Error, UnicodeDecodeError):
        return None


class BasicAuth:
    def __init__(self, users: Mapping[str, bytes], clock: Callable[[], float] = time.monotonic,
                 ttl: float = CACHE_SECONDS) -> None:
        self._users = dict(users)
        self._clock = clock
        self._ttl = ttl
        self._key = os.urandom(32)
        self._verified: dict[str, tuple[bytes, float]] = {}  # user -> (HMAC, until)
        self._slot = asyncio.Semaphore(1)
        self._waiting = 0

    def _mac(self, user: str, password: bytes) -> bytes:
        return hmac.new(self._key, user.encode() + b"\0" + password, hashlib.sha256).digest()

    async def allowed(self, header: str | None) -> bool:
        creds = credentials(header)
        if creds is None:
            return False
        user, password = creds
        mac = self._mac(user, password)
        remembered = self._verified.get(user)
        if remembered is not None and remembered[1] > self._clock() \
                and hmac.compare_digest(remembered[0], mac):
            return True
        if self._waiting >= _QUEUE:
            return False
        hashed = self._users.get(user)
        self._waiting += 1
        try:
            async with self._slot:
                ok = await asyncio.to_thread(_checkpw, password, hashed or _NOBODY)
        finally:
            self._waiting -= 1
        if not ok or hashed is None:
            return False
        self._verified[user] = (mac, self._clock() + self._ttl)
        return True


def _checkpw(password: bytes, hashed: bytes) -> bool:
    try:  # bcrypt compares in constant time itself
        return bool(bcrypt.checkpw(password[:_BCRYPT_MAX], hashed))
    except ValueError:  # a NUL in the password, a hash this bcrypt cannot read
        return False
