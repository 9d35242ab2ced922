"""Translation of foreign client APIs (DESIGN.md "Client APIs"): one
adapter module per API (:mod:`.adapters`), the relay of translated answers
(:mod:`.translate`), and the routes that use them (:mod:`.client_apis`,
whose names the proxy's server takes from here).
"""

from .client_apis import (
    CHAT_WITH_USAGE,
    ROUTES,
    ClientApis,
    adapter_for,
    handles,
    resolve,
    send_error,
    wants_usage,
)

__all__ = [
    "CHAT_WITH_USAGE",
    "ROUTES",
    "ClientApis",
    "adapter_for",
    "handles",
    "resolve",
    "send_error",
    "wants_usage",
]
