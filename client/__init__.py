"""The command-line client of a running ggmux server: ``ggmux ps``,
``load``, ``unload``, ``logs``, ``run``, ``cache`` (:mod:`.commands`) over
its public HTTP API (:mod:`.http_client`, stdlib ``http.client``). It is a
client like any SDK, not a part of the supervisor: it imports only
``shm/``'s log-line helpers."""
