"""The operator's web page: ``GET /`` and ``GET /ui/<file>``.

Static files shipped in the package (``proxy/operator/ui/``: plain HTML, CSS and
JavaScript, no CDN, no build step), read once and served from memory. They
need no key: they hold none, and the page asks for the API key (and, for
load, unload and logs, the admin key) when the server answers 401. A
Content-Security-Policy keeps the page to its own origin.
"""

from __future__ import annotations

from importlib import resources

from ...http1 import HttpConnection, Request

UI_FILES = {
    "index.html": b"text/html; charset=utf-8",
    "app.js": b"text/javascript; charset=utf-8",
    "logs.js": b"text/javascript; charset=utf-8",
    "requests.js": b"text/javascript; charset=utf-8",
    "usage.js": b"text/javascript; charset=utf-8",
    "style.css": b"text/css; charset=utf-8",
}

_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy",
     (b"default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
      b"connect-src 'self'; frame-ancestors 'none'")),
]


class Page:
    """The page's files, loaded on first use. :meth:`serve` answers a
    request for ``/`` (``index.html``) or ``/ui/<name>``."""

    def __init__(self) -> None:
        self.files: dict[bytes, tuple[bytes, bytes]] | None = None

    def _load(self) -> dict[bytes, tuple[bytes, bytes]]:
        if self.files is None:
            root = resources.files(__package__) / "ui"
            self.files = {}
            for name, ctype in UI_FILES.items():
                data = (root / name).read_bytes()
                self.files[b"/ui/" + name.encode()] = (data, ctype)
            self.files[b"/"] = self.files[b"/ui/index.html"]
        return self.files

    @staticmethod
    def wants(path: bytes) -> bool:
        """True for the paths this module serves."""
        return path == b"/" or path[:4] == b"/ui/"

    def serve(self, conn: HttpConnection, req: Request) -> None:
        """Answer ``GET``/``HEAD`` of a page file; 405 for other methods,
        404 for other names (only the listed files exist: no path reaches
        the file system)."""
        if req.method not in (b"GET", b"HEAD"):
            conn.send_error(req, 405, f"{req.path.decode('latin-1')} needs GET",
                            headers=[(b"allow", b"GET, HEAD")])
            return
        hit = self._load().get(req.path)
        if hit is None:
            conn.send_error(req, 404, f"no page file {req.path.decode('latin-1')}")
            return
        data, ctype = hit
        conn.send_response(req, 200, data, ctype, headers=_HEADERS)
