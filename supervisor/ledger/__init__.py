"""The usage ledger (issue 36): one row per finished request, kept in a store.

The proxies record every request they answer in the request ring
(:mod:`ggmux.shm.requestring`); the supervisor reads the ring on its poll
loop (:class:`.ledger.UsageLedger`, never blocking), turns each record into
a :class:`.records.UsageRow` and hands batches to a writer job
(:mod:`ggmux.supervisor.jobs`) that writes them to the store: SQLite by
default (:mod:`.sqlite`), PostgreSQL with ``--ledger postgresql://...``
(:mod:`.postgres`). Reading it: :mod:`.queries` (``GET /usage``, ``ggmux
usage``, the page), the status blob (:mod:`ggmux.shm.usagestatus`: /metrics
and the page).
"""
