"""Whether a replica received a request that got no answer: the kernel tells.

A connection that ends with no answer was delivered when it ended with a
clean close (FIN) after the replica's TCP acknowledged every byte we wrote
(``TCP_INFO``'s ``bytes_acked``: :func:`bytes_acked`); a replica already
dead or closing acknowledges nothing and answers a write with a reset
(:func:`peer_reset`), and one that dies before reading what its TCP
acknowledged resets the connection: neither got the request. How
:class:`~ggmux.http1.upstream.Upstream` weighs the two is in its module's
docstring. Linux only; elsewhere both say "unknown".
"""

from __future__ import annotations

import asyncio
import socket
import struct

_TCPI_BYTES_ACKED = 120  # offset of tcpi_bytes_acked in Linux's struct tcp_info (u64)
_TCP_CLOSE = 7  # tcpi_state (the struct's first byte) once a reset came


def peer_reset(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the peer reset the connection (``tcpi_state`` is CLOSE);
    False when the kernel does not say."""
    try:
        sock = transport.get_extra_info("socket")
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE
    except (AttributeError, OSError, IndexError, ValueError):
        return False


def bytes_acked(transport: asyncio.BaseTransport | None) -> int:
    """Bytes of ours the peer's TCP acknowledged, counting the SYN as one;
    -1 when the kernel does not say (not Linux, socket gone)."""
    try:
        sock = transport.get_extra_info("socket")
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES_ACKED + 8)
        return struct.unpack_from("Q", info, _TCPI_BYTES_ACKED)[0]
    except (AttributeError, OSError, struct.error, ValueError):
        return -1
