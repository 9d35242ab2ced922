"""The HTTP/1.1 server and client core (DESIGN.md "Processes"): the
connection protocol (:mod:`.connection`, with its reading half
:mod:`.reading` and writing half :mod:`.response`), the request record
(:mod:`.request`), the limits and their options (:mod:`.limits`), the
connection registry (:mod:`.connections`), the upstream client
(:mod:`.upstream`), its pool (:mod:`.pool`) and a replica's verdict on its
own answer (:mod:`.verdict`).

Shared by the proxy, the built-in instance and the supervisor; it imports
nothing else of ``ggmux.proxy``. The names below are those callers took
from the one module ``http1.py`` this was; the upstream client, the
pool and the verdict are imported from their modules.
"""

from .connection import HttpConnection
from .limits import (
    HttpLimits,
    add_http_limit_options,
    fit_fd_limit,
    http_limit_argv,
    limits_from_args,
)
from .reading import MAX_CHUNK_LINE
from .request import Header, Request, json_object, new_request_id
from .response import (
    CHUNKED,
    ERROR_CODES,
    ERROR_TYPES,
    LLAMA_CPP_ROUTES,
    ResponseWriter,
    error_body,
    error_code,
    status_line,
)

__all__ = [
    "CHUNKED",
    "ERROR_CODES",
    "ERROR_TYPES",
    "LLAMA_CPP_ROUTES",
    "MAX_CHUNK_LINE",
    "Header",
    "HttpConnection",
    "HttpLimits",
    "Request",
    "ResponseWriter",
    "add_http_limit_options",
    "error_body",
    "error_code",
    "fit_fd_limit",
    "http_limit_argv",
    "json_object",
    "limits_from_args",
    "new_request_id",
    "status_line",
]
