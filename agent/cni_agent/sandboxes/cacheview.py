"""The libcni cache as a view of the journal's records.

The records are the source of truth; the cache entries are written from them
without fsync, for other tools and people. At start-up (`agree`) and in each
reaping pass (`restore`) the view is made whole again from the records: an
entry a power loss took or zeroed is written again, and a result only an
entry holds (an older agent's record, or a crash between the ADD and its
mark) is taken into the record.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace

from cni_agent.cni.cache import CachedAttachment, ResultCache
from cni_agent.cni.errors import CacheError
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord
from cni_agent.sandboxes.store import SandboxStore

log = logging.getLogger(__name__)


def entry_of(rec: SandboxRecord, att: Attachment) -> CachedAttachment:
    """The cache entry of a recorded attachment with a result, as libcni's
    format has it (the caller's path as netns)."""
    return CachedAttachment(rec.sandbox_id, att.network, att.ifname, rec.netns, att.config,
                            att.args, att.capabilities, att.result)


def agree(store: SandboxStore, cache: ResultCache) -> list[str]:
    """Start-up, blocking, after the store's replay: scan the cache and make
    it agree with the records. What was found wrong, for the log."""
    notes: list[str] = []
    # After this agent's own clean stop, the entries it wrote before it are
    # what the journal says (nothing could tear them): their names do. One
    # changed since (another tool, a person) is read as any other.
    trusted = {os.path.basename(cache.path(a.network, rec.sandbox_id, a.ifname)):
               (a.network, rec.sandbox_id, a.ifname)
               for rec in store.records() for a in rec.attachments
               if a.result is not None} if store.clean_stop is not None else {}
    found, bad, taken = cache.scan(trusted, store.clean_stop or 0)
    entries = {(e.container_id, e.network, e.ifname): e for e in found}
    for rec in list(store.records()):
        atts = list(rec.attachments)
        taken_in = False
        for i, a in enumerate(atts):
            if trusted and os.path.basename(cache.path(a.network, rec.sandbox_id,
                                                       a.ifname)) in taken:
                continue
            entry = entries.get((rec.sandbox_id, a.network, a.ifname))
            if a.result is None and a.lost is None and entry is not None \
                    and entry.result is not None:
                atts[i] = replace(a, result=dict(entry.result))
                taken_in = True
            elif a.result is not None and a.phase is Phase.READY and a.lost is None and (
                    entry is None or entry.result != a.result):
                note = _write_again(cache, rec, a)
                notes.append(note or f"sandbox {rec.sandbox_id}: the cache entry of "
                             f"{a.network}/{a.ifname} was missing or damaged; written "
                             "again from the journal")
        if taken_in:
            store.write(replace(rec, attachments=tuple(atts)))
    if bad:
        notes.append(f"{len(bad)} unreadable cache entr{'y' if len(bad) == 1 else 'ies'} "
                     f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): a record that "
                     "names one DELs it with the recorded config")
    return notes


async def restore(store: SandboxStore, cache: ResultCache) -> list[str]:
    """A reaping pass's look at the cache: the entry of each ready attachment
    is there and not empty, else written again from its record (off the
    loop: a stat per entry). The attachments restored."""
    wanted = [(rec, a) for rec in store.records() for a in rec.attachments
              if a.phase is Phase.READY and a.lost is None and a.result is not None]

    def missing() -> list[int]:
        out = []
        for i, (rec, a) in enumerate(wanted):
            try:
                if os.stat(cache.path(a.network, rec.sandbox_id, a.ifname)).st_size > 0:
                    continue
            except OSError:
                pass
            out.append(i)
        return out

    restored = []
    for i in await asyncio.to_thread(missing) if wanted else []:
        rec, a = wanted[i]
        current = store.read(rec.sandbox_id)
        if current is None or current.attachment(a.ifname) is not a:
            continue  # changed meanwhile: its own call wrote what it needs
        note = _write_again(cache, rec, a)
        if note:
            log.warning("%s", note)
            continue
        restored.append(f"{rec.sandbox_id}/{a.ifname}")
    if restored:
        log.warning("cache entries missing or empty, written again from the journal: %s",
                    ", ".join(restored))
    return restored


def _write_again(cache: ResultCache, rec: SandboxRecord, a: Attachment) -> str | None:
    """Write `a`'s entry from its record; why not, if it was not."""
    if not cache.free_for(a.network, rec.sandbox_id, a.ifname):
        return (f"sandbox {rec.sandbox_id}: the cache entry of {a.network}/{a.ifname} is "
                "another attachment's file (their libcni names are the same): left as it is")
    try:
        cache.write(entry_of(rec, a))
    except CacheError as e:
        return (f"sandbox {rec.sandbox_id}: cannot restore the cache entry of "
                f"{a.network}/{a.ifname}: {e}")
    return None
