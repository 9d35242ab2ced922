"""The usage ledger: one row per finished request, kept in a store. Its own
package beside :mod:`ggmux.http1` and :mod:`ggmux.shm`, since the
supervisor writes it and the proxies read it (``GET /usage``); it imports
only :mod:`ggmux.shm` (the request ring, the key table), never the
supervisor nor the proxy (the supervisor's job runner it uses by its shape,
:class:`.jobs.Jobs`).

The proxies record every request they answer in the request ring
(:mod:`ggmux.shm.requestring`); the supervisor reads the ring on its poll
loop (:class:`.ledger.UsageLedger`, never blocking), turns each record into
a :class:`.records.UsageRow` and hands batches to a writer job that writes
them to the store: SQLite by default (:mod:`.sqlite`), PostgreSQL with
``--ledger postgresql://...`` (:mod:`.postgres`); the supervisor opens it in
:mod:`ggmux.supervisor.ledger_wiring`. Reading it: :mod:`.store` (``GET
/usage``, ``ggmux usage``, the page), the status blob
(:mod:`ggmux.shm.usagestatus`: /metrics and the page).
"""
