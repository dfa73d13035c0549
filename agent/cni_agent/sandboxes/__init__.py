"""The sandbox lifecycle: write-ahead journal and records, ordering, Setup/Teardown/Attach, reaping, GC.
The one owner of every attachment, from begin-add to gone.
May import: `cni`, `node`, `readiness`, `api`, `config`; never `service` or `cli`.
"""
