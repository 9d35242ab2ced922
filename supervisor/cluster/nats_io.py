"""NATS plumbing of the cluster agent: connecting, the KV buckets and
conditional writes with a per-message TTL (imported by the agent only).

nats-py's own ``KeyValue.create`` cannot set a TTL on an update and takes a
limit marker (the tombstone nats-server 2.11+ leaves when a TTL expires) for
a live value, so :func:`put_if` writes with the expected-last-sequence
header itself and treats every tombstone as "no value".
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable

import nats
import orjson
from nats.errors import NoServersError
from nats.js import api as js_api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError

from .options import ClusterOptions

log = logging.getLogger("ggmux.supervisor.cluster.nats_io")

WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream codes of a failed expected-sequence check
TOMBSTONE_OPS = ("DEL", "PURGE")


class Taken(Exception):
    """A conditional write found a live value: its ``seq`` and ``value`` (dict)."""

    def __init__(self, seq: int, value: dict) -> None:
        super().__init__(seq)
        self.seq = seq
        self.value = value


def fatal_reason(err: BaseException) -> str | None:
    """Why a connect error will not go away by retrying (naming the options
    to fix), or None for one that may (refused, timed out, no route)."""
    text = str(err)
    if "Authorization Violation" in text or "Authentication" in text:
        return (f"NATS refused the credentials ({text.strip()}): check the user and password "
                "or token in the --cluster URL or --nats-user/--nats-password/--nats-token/"
                "--nats-creds")
    if isinstance(err, ssl.SSLError):
        return f"TLS to NATS failed ({text}): check the tls:// --cluster URL and --nats-tls-ca"
    return None


async def connect(o: ClusterOptions, on_gone: Callable[[], Awaitable[None]]):
    """One connection attempt to ``o.url`` with ``o``'s credentials; no
    reconnects of nats-py's own (the agent reconnects with its backoff and
    republishes). ``on_gone`` runs when the connection drops or closes.
    Pings every ``--heartbeat`` (at least 1 s), three unanswered drop it."""

    errors: list[BaseException] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)
        log.debug("nats: %r", e)

    kw: dict = {}
    if o.user:
        kw.update(user=o.user, password=o.password)
    if o.token:
        kw["token"] = o.token
    if o.creds:
        kw["user_credentials"] = o.creds
    if o.url.startswith("tls://"):
        kw["tls"] = ssl.create_default_context(cafile=o.tls_ca or None)
    try:
        return await nats.connect(
            servers=[o.url], name=f"ggmux {o.node}", allow_reconnect=False,
            max_reconnect_attempts=1, reconnect_time_wait=0.05,
            connect_timeout=max(1.0, o.heartbeat), ping_interval=max(1.0, o.heartbeat),
            max_outstanding_pings=3, disconnected_cb=on_gone, closed_cb=on_gone,
            error_cb=on_error, **kw)
    except NoServersError:
        # nats-py's "no servers available" hides the cause it passed to error_cb
        if errors:
            raise errors[-1] from None
        raise


async def open_bucket(js, bucket: str, marker_ttl: float):
    """The KV ``bucket``, created if missing: history 1 (a key is its last
    value), file storage, per-message TTLs allowed, and limit markers that
    live ``marker_ttl`` s, so watchers see a key whose TTL ran out."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    return await js.create_key_value(bucket=bucket, history=1,
                                     storage=js_api.StorageType.FILE,
                                     limit_marker_ttl=max(1.0, marker_ttl))


def is_tombstone(headers: dict | None) -> bool:
    """A KV message that says "no value" (a delete, a purge, a limit marker)."""
    if not headers:
        return False
    return headers.get("KV-Operation") in TOMBSTONE_OPS or "Nats-Marker-Reason" in headers


async def put_if(js, bucket: str, key: str, value: bytes, last: int, ttl: float) -> int:
    """Write ``key`` in ``bucket`` if its last revision is ``last`` (0: none)
    with a TTL of ``ttl`` s; a tombstone or an expired value counts as none.
    Returns the new revision; raises :class:`Taken` for a live value that
    someone else wrote, ``ConnectionError`` if the key keeps changing, and
    nats-py's errors when NATS does not answer."""
    subject = f"$KV.{bucket}.{key}"
    for _ in range(3):
        hdrs = {js_api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)}
        try:
            ack = await js.publish(subject, value, headers=hdrs, msg_ttl=ttl)
            return ack.seq
        except APIError as e:
            if e.err_code not in WRONG_LAST_SEQUENCE:
                raise
        try:
            msg = await js.get_last_msg(f"KV_{bucket}", subject)
        except NotFoundError:
            last = 0
            continue
        if is_tombstone(msg.headers):
            last = msg.seq
            continue
        try:
            current = orjson.loads(msg.data or b"{}")
        except orjson.JSONDecodeError:
            current = {}
        raise Taken(msg.seq, current if isinstance(current, dict) else {})
    raise ConnectionError(f"cannot write {bucket}/{key}: it keeps changing")
