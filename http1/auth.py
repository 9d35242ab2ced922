"""Keys: the client's API key, the admin key, and each instance's secret.

Rules (issue 11, findings 6 and 7):

* A key is compared in constant time (:func:`authorized`); it comes as
  ``Authorization: Bearer KEY`` or ``x-api-key: KEY``.
* No key is ever on a command line or in an environment (both are readable
  by other users through ``/proc`` or ``ps``, and environments are
  inherited): the supervisor hands a child its keys through an inherited
  pipe (:func:`keys_pipe`, the child's ``--keys-fd``; :func:`read_keys`),
  or on its stdin command pipe (the cluster agent: its first line), and
  removes every secret variable (``GGMUX_*_KEY``, the cluster token, NATS
  passwords and tokens) from every child's environment (:func:`scrub_env`).
* A built-in instance learns who asked only as a tenant (:func:`tenant`):
  a keyed hash of the caller's key, never the key (issue 18, findings 6
  and 10: prompt-cache scope and slot fairness).
* Every local instance requires a secret of its own, 128 random bits the
  supervisor makes per spawn (:func:`new_secret`), so that no local user can
  go around ``--api-key`` by talking to an instance port directly. The
  proxies read it from the replicas table (the segment is mode 0600) and
  send it as the instance's bearer token (:func:`secret_header`); the
  client's own credentials never reach a replica (``heads.request_head``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets

import orjson

from . import Request
from .request import TENANT

log = logging.getLogger(__name__)

# secrets in the environment: the keys, the cluster token, NATS passwords and
# tokens (GGMUX_API_KEY, GGMUX_CLUSTER_TOKEN, GGMUX_NATS_PASSWORD, ...)
_SECRET_ENV = re.compile(r"GGMUX_\w*(?:KEY|TOKEN|PASSWORD|SECRET)\w*\Z")
# a URL with credentials in it (GGMUX_CLUSTER=nats://user:password@host)
_URL_WITH_CREDENTIALS = re.compile(r"\A\s*[A-Za-z][\w+.-]*://[^/@\s]*@")
_MASK = (1 << 64) - 1


def given_key(req: Request) -> bytes | None:
    """The key a request presents (``x-api-key``, else a Bearer token), or None."""
    given = req.header(b"x-api-key")
    if given is None:
        auth = req.header(b"authorization") or b""
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
    return given


def authorized(req: Request, key: bytes | None) -> bool:
    """Whether ``req`` presents ``key`` (always, when ``key`` is None),
    compared in constant time."""
    if key is None:
        return True
    given = given_key(req)
    return given is not None and hmac.compare_digest(given, key)


def tenant(req: Request, secret: bytes, trusted_hop: bool = False) -> bytes:
    """The ``x-ggmux-tenant`` value of ``req`` (16 lower-case hex digits):
    HMAC-SHA256 of the key it presents, keyed by ``secret`` (one per server,
    shared by its proxies: the same key is the same tenant through any of
    them, and no replica can tell the key from it), truncated to 64 bits;
    ``b""`` for a request presenting no key. A request forwarded by another
    node with the cluster token (``trusted_hop``) keeps the tenant that node
    gave it; a client's own header is never believed."""
    if trusted_hop:
        v = req.header(TENANT) or b""
        return v if len(v) == 16 and all(c in b"0123456789abcdef" for c in v) else b""
    key = given_key(req)
    if not key:
        return b""
    return hmac.new(secret, key, hashlib.sha256).hexdigest()[:16].encode()


def new_secret() -> tuple[str, int, int]:
    """A fresh instance secret: ``(hex text, high word, low word)``, 128
    random bits from :mod:`secrets`; the words are signed int64 as the
    replicas table stores them (``R_SECRET_HI``, ``R_SECRET_LO``)."""
    v = secrets.randbits(128) | 1  # never all zero: (0, 0) means "no secret"
    hi, lo = v >> 64, v & _MASK
    return f"{v:032x}", _signed(hi), _signed(lo)


def _signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def secret_text(hi: int, lo: int) -> str:
    """The hex text of the secret stored as words ``hi``, ``lo``; ``""`` for none."""
    if not hi and not lo:
        return ""
    return f"{((hi & _MASK) << 64) | (lo & _MASK):032x}"


def secret_header(hi: int, lo: int) -> bytes:
    """The header line a proxy sends to the instance with secret ``hi``,
    ``lo`` (``b""`` for none)."""
    text = secret_text(hi, lo)
    return b"authorization: Bearer %s\r\n" % text.encode() if text else b""


def keys_pipe(doc: dict) -> int:
    """A pipe holding ``doc`` as JSON, its write end closed: the read end's
    descriptor, for a child's ``pass_fds`` and ``--keys-fd`` (the caller
    closes it after the spawn). Keys are small: the write never blocks."""
    data = orjson.dumps(doc)
    r, w = os.pipe()
    try:
        os.write(w, data)
    finally:
        os.close(w)
    return r


def read_keys(fd: int) -> dict:
    """What :func:`keys_pipe` wrote (read to EOF, then ``fd`` is closed);
    ``{}`` for an empty pipe. Raises ``ValueError`` on bad JSON and
    ``TypeError`` on JSON that is not an object."""
    chunks = []
    try:
        while True:
            b = os.read(fd, 65536)
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    doc = orjson.loads(data) if data else {}
    if not isinstance(doc, dict):
        raise TypeError("--keys-fd: not a JSON object")
    return doc


def scrub_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without its secrets: what a child may inherit (issue 11
    finding 6; the cluster's since issue 13). Removed: ``GGMUX_*`` variables
    whose name holds ``KEY``, ``TOKEN``, ``PASSWORD`` or ``SECRET``
    (``GGMUX_API_KEY``, ``GGMUX_ADMIN_KEY``, ``GGMUX_CLUSTER_TOKEN``,
    ``GGMUX_NATS_PASSWORD``, ``GGMUX_NATS_TOKEN``), and any ``GGMUX_*``
    whose value is a URL with credentials in it (``GGMUX_CLUSTER``)."""
    return {k: v for k, v in env.items()
            if not (_SECRET_ENV.match(k)
                    or k.startswith("GGMUX_") and _URL_WITH_CREDENTIALS.match(v))}


__all__ = ["authorized", "given_key", "keys_pipe", "new_secret", "read_keys", "scrub_env",
           "secret_header", "secret_text", "tenant"]
