"""The proxy's own answers to requests it could not forward, or not to the end.

Each is OpenAI's error envelope with the status the case calls for (docs/apis.md,
"HTTP surface"), or, for a streaming request whose SSE head already went
out (keep-alive comments while its model loaded), the same envelope as an
SSE ``data:`` event followed by a cut connection, never a clean end.
Functions of the connection and the facts; no proxy state.
"""

from __future__ import annotations

import logging
import time

import orjson

from ..http1 import HttpConnection, Request
from ..http1.exchange import UpstreamError
from ..shm import layout as L
from .contention import OTHER_MODEL

log = logging.getLogger(__name__)

NS = 1_000_000_000
RETRY_STOPPING = b"5"  # Retry-After while the server stops, seconds


def sse_error(conn: HttpConnection, req: Request, message: str, type_: str,
              code: str) -> None:
    """The error as one SSE event into a stream whose head went out, then
    the connection closed."""
    err = {"error": {"message": message, "type": type_, "code": code}}
    conn.send_chunk(b"data: " + orjson.dumps(err) + b"\n\n")
    conn.close()
    conn.finish(req)


def _error(conn: HttpConnection, req: Request, status: int, message: str, code: str,
           type_: str, headers=(), **extra) -> None:
    if req.preheaded:
        sse_error(conn, req, message, type_, code)
    else:
        conn.send_error(req, status, message, code=code, headers=headers, **extra)


def load_failed(conn: HttpConnection, req: Request, name: str, row, cause: str) -> None:
    """503: the model's last load failed and it is in backoff (``row``: its
    models-table row, for the retry time)."""
    retry = max(1, -(-(int(row[L.M_RETRY_AT_NS]) - time.monotonic_ns()) // NS))
    _error(conn, req, 503, f"model '{name}' failed to load: {cause}", "model_load_failed",
           "unavailable_error", headers=[(b"retry-after", str(retry).encode())])


def still_loading(conn: HttpConnection, req: Request, name: str, row, load_wait: float,
                  more: dict | None = None, why: str = "") -> None:
    """503 with a ``loading`` object: the model did not become ready within
    ``--load-wait`` seconds; ``more`` joins the object (cluster mode: the
    node and state of the model's cluster-wide load); ``why``: what it
    waited for, when other models held its capacity (issue 34: the queue's
    reason, also ``loading.why``)."""
    retry = b"5"
    if why and int(row[L.M_STATUS]) != L.ModelStatus.LOADING:
        msg = f"model '{name}' waited {load_wait:g} s (--load-wait) for capacity: {why}"
        more = {**(more or {}), "why": why}
        eta = int(row[L.M_WAIT_ETA_NS])  # the capacity frees then: try again after
        if eta:
            retry = str(max(1, -(-(eta - time.monotonic_ns()) // NS))).encode()
    else:
        msg = f"model '{name}' is still loading after {load_wait:g} s (--load-wait)"
    if req.preheaded:
        sse_error(conn, req, msg, "unavailable_error", "model_loading")
        return
    status = L.ModelStatus.NAMES[int(row[L.M_STATUS])]
    eta = int(row[L.M_ETA_MS])
    loading = {"model": name, "state": status, "progress": int(row[L.M_PROGRESS]) / 1000,
               "eta_seconds": eta / 1000 if eta >= 0 else None, **(more or {})}
    conn.send_error(req, 503, msg, code="model_loading", headers=[(b"retry-after", retry)],
                    loading=loading)


def capacity_pinned(conn: HttpConnection, req: Request, name: str, row,
                    model_name) -> None:
    """503: only pinned models hold the capacity model ``name`` needs, so
    nothing will free it (issue 34; llama.cpp's router answers an error
    rather than break its limit when every loaded model is pinned).
    ``row``: its models-table row; ``model_name(i)``: a model's name."""
    holder = int(row[L.M_WAIT_HOLDER]) - 1
    held_by = model_name(holder) if holder >= 0 else ""
    who = ("pinned models (pin = true), which are never evicted; unload one" if not held_by
           else "another pinned model (pin = true), which is never evicted; unload it"
           if held_by == OTHER_MODEL else
           f"pinned model '{held_by}' (pin = true), which is never evicted; unload it")
    _error(conn, req, 503, f"model '{name}' cannot load: its capacity is held by {who} "
           "or raise --models-max",
           "capacity_pinned", "unavailable_error", headers=[(b"retry-after", b"30")])


def stopping(conn: HttpConnection, req: Request) -> None:
    """503 ``shutting_down``: the server stops and takes no new work (issue
    11: an accepted request gets an answer, never a bare close)."""
    _error(conn, req, 503, "the server is stopping", "shutting_down", "unavailable_error",
           headers=[(b"retry-after", RETRY_STOPPING)])


def circuit_open(conn: HttpConnection, req: Request, name: str, until_ns: int) -> None:
    """503 with Retry-After: every replica of the model failed recently and
    its circuit is open until ``until_ns`` (issue 11: at once, not a 429
    after the queue timeout)."""
    retry = max(1, -(-(until_ns - time.monotonic_ns()) // NS))
    _error(conn, req, 503, f"every replica of '{name}' failed recently (its circuit is open); "
           f"try again in {retry} s", "replica_unavailable", "unavailable_error",
           headers=[(b"retry-after", str(retry).encode())])


def replica_failed(conn: HttpConnection, req: Request, name: str, err: UpstreamError) -> None:
    """The replica took the request and then failed without answering:
    504 when it timed out, else 502. Either way it is not sent again (issue
    11: a request that kills its replica would kill the next one too)."""
    if req.disconnected:
        conn.finish(req)
        return
    if err.timeout:
        _error(conn, req, 504, f"the replica of '{name}' did not answer in time: {err}",
               "replica_timeout", "timeout_error")
    else:
        _error(conn, req, 502, f"the replica of '{name}' died or hung up while serving this "
               f"request ({err}); it is not sent again, since it may be what broke the replica",
               "replica_died", "server_error")


def unreachable(conn: HttpConnection, req: Request, name: str, err: UpstreamError) -> None:
    """502: no replica of the model could be reached in any attempt."""
    _error(conn, req, 502, f"replica for '{name}' failed: {err}", "replica_unreachable",
           "server_error")


__all__ = ["capacity_pinned", "circuit_open", "load_failed", "replica_failed", "sse_error", "still_loading",
           "stopping", "unreachable"]
