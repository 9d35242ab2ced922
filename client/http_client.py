"""A small HTTP client of one ggmux server (stdlib ``http.client``), for
the client commands (:mod:`.commands`).

Every request has a deadline (:data:`DEFAULT_TIMEOUT_S`, ``--timeout``:
to connect, for the head, and for the whole of a non-streamed answer; a
stream, once its head came, as long as it lasts) and a non-streamed answer
a size cap (:data:`MAX_ANSWER_BYTES`, ``--max-answer-bytes``; also for one
event of a stream), so that a silent, endless or foreign server costs
neither a hang nor the machine's memory (issue 18, finding 9). What is no
usable answer raises :class:`NoAnswer` with a one-line message.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_TIMEOUT_S = 10.0
MAX_ANSWER_BYTES = 16 << 20  # 16 MiB: a /ps of thousands of models is well under 1 MiB
ERROR_BODY_BYTES = 64 << 10  # of an error answer, enough for its message


class ServerError(Exception):
    """The server answered with an error status: ``status`` and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NoAnswer(Exception):
    """No usable answer (exit 3): none in time, the connection closed, not
    JSON, not the shape ggmux sends, over the size cap."""


class NoServer(NoAnswer):
    """Nothing answered at the URL (refused, unreachable, connect timed out)."""


class TimedOut(NoAnswer):
    """The server sent nothing within the time it had."""


def split_url(url: str):
    """``url`` (``--url`` or ``$GGMUX_URL``; no scheme: ``http://``) split
    by :func:`urllib.parse.urlsplit`, checked so that no later step raises
    on it (issue 31, item 9). Raises ``ValueError`` with one line naming
    the URL for: a space or control character anywhere, a scheme other than
    http(s), no host, a host that no DNS name can be (IDNA), a port that is
    not a number in 1-65535, a path that is not ASCII, a query or fragment
    (the URL names a server and an optional path prefix, nothing more)."""
    shown = repr(url)
    if not url or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError(f"not an http:// URL: {shown}"
                         + (" (it holds a space or a control character)" if url else ""))
    try:
        u = urlsplit(url if "://" in url else "http://" + url)
        port = u.port
    except ValueError as e:  # "Port out of range", "Invalid IPv6 URL", ...
        raise ValueError(f"not an http:// URL: {shown} ({e})") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http:// URL: {shown}")
    if port == 0:
        raise ValueError(f"not an http:// URL: {shown} (port 0)")
    if u.query or u.fragment or url.endswith(("?", "#")):
        raise ValueError(f"not an http:// URL: {shown} (a server URL has no ? or #)")
    if not u.path.isascii():
        raise ValueError(f"not an http:// URL: {shown} (its path is not ASCII; "
                         "percent-encode it)")
    try:
        u.hostname.encode("idna")
    except UnicodeError:
        raise ValueError(f"not an http:// URL: {shown} (its host is no DNS name)") from None
    return u


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n} bytes"


class Client:
    """A small HTTP client of one ggmux server at ``url`` (``http://`` or
    ``https://``, an optional path prefix), sending ``key`` as a Bearer token
    (``admin_key`` on admin routes when given). ``timeout`` (seconds) bounds
    the connect, the head and a whole non-streamed answer; ``max_bytes`` a
    non-streamed answer and one event of a stream. Raises ``ValueError`` for
    a URL that :func:`split_url` refuses, or limits that are not above 0."""

    def __init__(self, url: str, key: str | None = None, admin_key: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, max_bytes: int = MAX_ANSWER_BYTES) -> None:
        u = split_url(url)
        if not timeout > 0 or max_bytes < 1:
            raise ValueError("--timeout and --max-answer-bytes must be above 0")
        self.url = url
        self.scheme = u.scheme
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self.key = key
        self.admin_key = admin_key
        self.timeout = timeout
        self.max_bytes = max_bytes

    def no_answer(self, method: str, path: str, why: str, cls: type = NoAnswer) -> NoAnswer:
        """The one-line error for an unusable answer to ``method path``."""
        return cls(f"no usable answer from {self.url} to {method} {path}: {why}")

    def shape(self, method: str, path: str, why: str) -> NoAnswer:
        """:meth:`no_answer` for an answer that is not what ggmux sends."""
        return self.no_answer(method, path, f"{why} (is it a ggmux server?)")

    def _open(self, method: str, path: str, body=None,
              admin: bool = False) -> tuple[http.client.HTTPResponse, socket.socket, float]:
        """Send the request, read the head: ``(response, socket, deadline)``
        (``time.monotonic()`` seconds). Raises :class:`ServerError` for an
        error status, :class:`NoAnswer` (:class:`NoServer`,
        :class:`TimedOut`) when none came."""
        deadline = time.monotonic() + self.timeout
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        headers = {"accept": "*/*"}
        key = (self.admin_key if admin and self.admin_key else None) or self.key
        if key:
            headers["authorization"] = "Bearer " + key
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        try:
            conn.connect()
        except OSError as e:
            conn.close()
            raise NoServer(f"no server answers at {self.url} ({e.strerror or e})") from None
        sock = conn.sock  # kept: the response may hold it after the connection let go
        try:
            conn.request(method, self.prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
        except TimeoutError:
            conn.close()
            raise self.no_answer(method, path, f"nothing within {self.timeout:g} s (--timeout)",
                                 TimedOut) from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise self.no_answer(method, path, f"the connection closed ({e!r})") from None
        if resp.status >= 400:
            try:
                text = self._body(resp, sock, method, path, deadline, ERROR_BODY_BYTES, True)
            except NoAnswer:  # the status is the answer; its message did not come
                text = b""
            finally:
                conn.close()
            raise ServerError(resp.status, error_message(text) or f"HTTP {resp.status}")
        return resp, sock, deadline

    def _body(self, resp: http.client.HTTPResponse, sock: socket.socket, method: str,
              path: str, deadline: float, limit: int, truncate: bool = False) -> bytes:
        """The body, read by ``deadline``; over ``limit`` bytes it is
        :class:`NoAnswer`, or cut there with ``truncate``."""
        if resp.length is not None and resp.length > limit and not truncate:
            raise self.no_answer(method, path, f"{_size(resp.length)} announced, over the "
                                 f"{_size(limit)} cap (--max-answer-bytes)")
        chunks, size = [], 0
        try:
            while size <= limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                b = resp.read1(min(1 << 16, limit + 1 - size))
                if not b:
                    break
                chunks.append(b)
                size += len(b)
        except TimeoutError:
            raise self.no_answer(method, path, f"not all of it within {self.timeout:g} s "
                                 "(--timeout)", TimedOut) from None
        except (OSError, http.client.HTTPException) as e:
            raise self.no_answer(method, path, f"the connection closed mid-answer ({e!r})") \
                from None
        if size > limit and not truncate:
            raise self.no_answer(method, path, f"over the {_size(limit)} cap "
                                 "(--max-answer-bytes)")
        return b"".join(chunks)[:limit]

    def json(self, method: str, path: str, body=None, admin: bool = False):
        """The decoded JSON answer (None for an empty body); raises
        :class:`ServerError`, :class:`NoAnswer`."""
        resp, sock, deadline = self._open(method, path, body, admin)
        try:
            data = self._body(resp, sock, method, path, deadline, self.max_bytes)
        finally:
            resp.close()
            sock.close()
        try:
            return parse_json(data) if data.strip() else None
        except ValueError:
            raise self.shape(method, path, f"not JSON ({data[:60]!r})") from None

    def object(self, method: str, path: str, body=None, admin: bool = False) -> dict:
        """:meth:`json` that must be a JSON object."""
        doc = self.json(method, path, body, admin)
        if not isinstance(doc, dict):
            raise self.shape(method, path, f"a JSON {json_kind(doc)}, not an object")
        return doc

    def text(self, path: str, admin: bool = False) -> str:
        resp, sock, deadline = self._open("GET", path, admin=admin)
        try:
            data = self._body(resp, sock, "GET", path, deadline, self.max_bytes)
        finally:
            resp.close()
            sock.close()
        return data.decode("utf-8", "replace")

    def events(self, method: str, path: str, body=None, admin: bool = False,
               deadline: float | None = None) -> Iterator[tuple[str, str]]:
        """Server-sent events as ``(event, data)``; a comment comes as
        ``("comment", text)`` (ggmux's "waiting for the model" lines). Once
        the head came the stream may last as long as it does, or until
        ``deadline`` (``time.monotonic()`` seconds; then :class:`TimedOut`).
        Raises :class:`NoAnswer` for an answer that is not an event stream,
        an event over ``max_bytes``, or a connection that closed mid-event."""
        resp, sock, _ = self._open(method, path, body, admin)
        try:
            ctype = resp.getheader("content-type") or "no content type"
            if not ctype.startswith("text/event-stream"):
                raise self.shape(method, path, f"{ctype}, not an event stream")
            event, data, size = "message", [], 0
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                try:
                    if left is not None and left <= 0:
                        raise TimeoutError
                    sock.settimeout(left)
                    raw = resp.readline(self.max_bytes + 1)
                except TimeoutError:
                    raise self.no_answer(method, path, "nothing more in time",
                                         TimedOut) from None
                except (OSError, http.client.HTTPException) as e:
                    raise self.no_answer(method, path, f"the connection closed mid-stream "
                                         f"({e!r})") from None
                if not raw:
                    return
                size += len(raw)
                if size > self.max_bytes:
                    raise self.no_answer(method, path, f"an event over the "
                                         f"{_size(self.max_bytes)} cap (--max-answer-bytes)")
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if not line:
                    if data:
                        yield event, "\n".join(data)
                    event, data, size = "message", [], 0
                elif line.startswith(":"):
                    size = 0
                    yield "comment", line[1:].strip()
                else:
                    field, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if field == "event":
                        event = value
                    elif field == "data":
                        data.append(value)
        finally:
            resp.close()
            sock.close()


def json_kind(doc) -> str:
    """The JSON name of ``doc``'s type (``object``, ``array``, ...), for messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            type(None): "null"}.get(type(doc), "number")


def parse_json(data: bytes | str):
    """``json.loads``, with nesting too deep for it a ``ValueError`` too."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def error_message(body: bytes) -> str:
    """The message of an error answer: its envelope's ``error.message`` (or
    ``error`` text), else the body's first 500 characters."""
    try:
        doc = parse_json(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500]
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return str(doc)[:500]


def number(x) -> float | None:
    """``x`` when it is a real number (not a bool, not NaN), else None."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x):
        return float(x)
    return None


def items(client: Client, method: str, path: str, doc: dict, key: str,
          needs: tuple[str, ...]) -> list[dict]:
    """``doc[key]``, a list of objects each with a string for every name of
    ``needs`` (``/ps`` models need ``id`` and ``state``); raises
    :class:`NoAnswer` naming what is missing."""
    if key not in doc:
        raise client.shape(method, path, f"no '{key}' in the answer")
    found = doc[key]
    if not isinstance(found, list):
        raise client.shape(method, path, f"'{key}' is a JSON {json_kind(found)}, not an array")
    for i, item in enumerate(found):
        if not isinstance(item, dict):
            raise client.shape(method, path,
                               f"{key}[{i}] is a JSON {json_kind(item)}, not an object")
        for name in needs:
            if not isinstance(item.get(name), str):
                raise client.shape(method, path, f"{key}[{i}] has no string '{name}'")
    return found
