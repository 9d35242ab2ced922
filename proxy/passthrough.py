"""``/upstream/<model>/<path>``: which model, and what the replica is asked for.

Pure functions, no I/O (the proxy forwards). Two rules from issue 11:

* **Dot segments** (RFC 3986 5.2.4 ``remove_dot_segments``) are resolved in
  the sub-path before it goes to a replica, with ``%2e`` read as ``.`` (RFC
  3986 6.2.2.2: percent-encoded unreserved characters are equivalent to the
  characters), so no ``..`` can climb out of an upstream's configured path
  prefix (``upstream = http://host/api`` must never be asked for
  ``/admin``). A segment that decodes to something with ``/`` or ``\\`` in it
  (``..%2f..``) is refused (:class:`BadPath`): some servers decode it into a
  separator after we checked.
* **Model file paths** are not shown to callers without the admin key:
  :func:`redact_paths` turns every absolute path in a JSON answer of
  :data:`REDACTED_PATHS` (llama-server's ``/props`` has ``model_path``; its
  ``/v1/models`` ids may be paths) into its base name, and
  :func:`redact_slots` drops what a ``/slots`` answer says about other
  clients' requests (issue 18, finding 6: any key holder read every
  client's ``x-request-id`` there).

Issue 37, item 3: a replica's own admin routes (:func:`admin_target`: the
built-in instance's KV tiers ``/cache`` and ``/cache/clear``,
llama-server's slot actions ``/slots/<id>?action=save|restore|erase``, its
``POST /props``, ``POST /lora-adapters``, router-mode ``/models/load`` and
``/models/unload``) change or show what every tenant of the replica shares:
with only an API key, ``POST /upstream/<model>/cache/clear`` emptied every
tenant's KV tiers and ``GET .../cache`` showed the disk path and every
tenant's counters. They are served only to the admin key (ggmux's own
``/cache`` routes and ``ggmux cache`` do the same work with ggmux's rules).
"""

from __future__ import annotations

import logging
import posixpath
from urllib.parse import unquote

import orjson

log = logging.getLogger(__name__)

PREFIX = b"/upstream/"

# replica routes whose JSON answers may carry a model file's path
REDACTED_PATHS = frozenset((b"/props", b"/v1/models", b"/models", b"/slots"))


# a replica's routes that change or show what all its tenants share (module docstring)
ADMIN_PATHS = frozenset((b"/cache", b"/cache/clear", b"/models/load", b"/models/unload"))
ADMIN_PREFIXES = (b"/slots/", b"/cache/")
# routes that only read on GET but change the whole replica on any other method
ADMIN_WRITES = frozenset((b"/props", b"/lora-adapters", b"/slots"))


def admin_target(target: bytes, method: bytes) -> bool:
    """Whether ``target`` (a normalized pass-through target, query and
    all) with ``method`` is one of a replica's admin routes (module
    docstring). The path is compared as a server would route it: percent
    escapes decoded (cpp-httplib decodes them), runs of ``/`` and a final
    ``/`` ignored, so no spelling of a route slips past."""
    path = target.split(b"?", 1)[0]
    if path.find(b"%") >= 0:
        path = unquote(path.decode("latin-1"), encoding="latin-1").encode("latin-1")
    while path.find(b"//") >= 0:
        path = path.replace(b"//", b"/")
    if len(path) > 1:
        path = path.rstrip(b"/") or b"/"
    if path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES):
        return True
    return path in ADMIN_WRITES and method not in (b"GET", b"HEAD")


class BadPath(ValueError):
    """A pass-through path that cannot be forwarded safely (a 400)."""


def normalize(sub: bytes) -> bytes:
    """``sub`` (a path starting with ``/``, no query) with ``.`` and ``..``
    segments resolved; ``..`` at the top stays at the top. Cheap when
    there is nothing to do (no ``.``, ``%`` or ``\\``).

    Raises :class:`BadPath` for a segment that decodes to one holding ``/``
    or ``\\``, or a backslash anywhere (a separator on some servers)."""
    # (find, not `in`: on bytes, CPython 3.11's `in` first tries its operand
    # as an integer, building and dropping a TypeError: ~2,000 instructions)
    if sub.find(b".") < 0 and sub.find(b"%") < 0 and sub.find(b"\\") < 0:
        return sub
    if sub.find(b"\\") >= 0:
        raise BadPath("a backslash in an /upstream/ path")
    out: list[bytes] = []
    segs = sub.split(b"/")[1:]
    last = len(segs) - 1
    for i, seg in enumerate(segs):
        plain = unquote(seg.decode("latin-1"), encoding="latin-1") if b"%" in seg else None
        if plain is not None and ("/" in plain or "\\" in plain):
            raise BadPath("an encoded '/' or '\\' in an /upstream/ path")
        word = seg if plain is None else plain.encode("latin-1")
        if word == b".":
            if i == last:
                out.append(b"")  # "/a/." -> "/a/"
            continue
        if word == b"..":
            if out:
                out.pop()
            if i == last:
                out.append(b"")
            continue
        out.append(seg)
    return b"/" + b"/".join(out)


def target(sub: bytes, query: bytes) -> bytes:
    """The request target for the replica: ``sub`` normalized (see
    :func:`normalize`, which may raise :class:`BadPath`), with ``query``."""
    sub = normalize(sub)
    return sub + b"?" + query if query else sub


def quick_route(path: bytes, query: bytes, slashed: list[str]) -> tuple[str, bytes] | None:
    """``(model name, target)`` of ``/upstream/<name>/...`` in the common
    case, a name without ``/`` or ``%`` that no registered name with ``/``
    (``slashed``) extends; None otherwise (the name may not be registered:
    the caller checks). Raises :class:`BadPath`."""
    i = path.find(b"/", 10)
    raw = path[10:] if i < 0 else path[10:i]
    if raw.find(b"%") >= 0:  # (find: see normalize)
        return None
    name = raw.decode("latin-1")
    if slashed and any(n.startswith(name + "/") for n in slashed):
        return None
    return name, target(b"/" if i < 0 else path[i:], query)


def route(path: bytes, query: bytes, names, slashed: list[str]) -> tuple[str, bytes] | None:
    """``(model name, target)`` of a pass-through path, or None when it
    names no registered model. Names may contain ``/`` and are matched
    URL-decoded; the longest registered name wins. Raises :class:`BadPath`."""
    found = quick_route(path, query, slashed)
    if found is not None and found[0] in names:
        return found
    rest = path[len(PREFIX):].decode("latin-1")
    found = None
    for i, ch in enumerate(rest + "/"):
        if ch == "/":
            name = unquote(rest[:i])
            if name in names:
                found = (name, (rest[i:] or "/").encode("latin-1"))
    if found is None:
        return None
    return found[0], target(found[1], query)


def _redact(v):
    if isinstance(v, str):
        if v.startswith("/") and "\n" not in v and " " not in v.strip():
            return posixpath.basename(v.rstrip("/")) or v
        return v
    if isinstance(v, dict):
        return {k: _redact(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_redact(x) for x in v]
    return v


# what a /slots entry tells about the request in it: ggmux's request id and
# tenant, llama-server's prompt and generated text (with --slots-debug)
SLOT_PRIVATE = ("request_id", "tenant", "prompt", "generated")


def redact_slots(body: bytes) -> bytes:
    """A ``/slots`` answer (a JSON list of slots, or llama-server's error
    object) without :data:`SLOT_PRIVATE` in any slot; a body that is not
    JSON comes back unchanged."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(doc, list):
        return body
    return orjson.dumps([{k: v for k, v in s.items() if k not in SLOT_PRIVATE}
                         if isinstance(s, dict) else s for s in doc])


def redact_paths(body: bytes) -> bytes:
    """``body`` (a JSON answer) with every string that is an absolute path
    (starts with ``/``, no whitespace) replaced by its base name; a body
    that is not JSON comes back unchanged."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    return orjson.dumps(_redact(doc))


__all__ = ["ADMIN_PATHS", "REDACTED_PATHS", "BadPath", "admin_target", "normalize", "quick_route", "redact_paths",
           "redact_slots", "route", "target"]
