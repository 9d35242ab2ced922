"""The floor of a Python proxy on ggmux's libraries: an HTTP/1.1 relay on
uvloop and httptools that does nothing but parse each request, send it to
one upstream over a kept-alive connection, parse the answer and send it
back (no validation, limits, keys, routing, accounting or logging).

``bench/proxy_instructions.py --builds floor`` counts its instructions per
request beside ggmux's proxy and nginx's worker: what ggmux's own work
costs on top of the interpreter and the two libraries every request goes
through (a parser callback into Python per header, a ``data_received`` per
read). Not a server to use: one upstream, no errors handled.

``python -m bench.relay_floor --port PORT --upstream UPSTREAM_PORT``
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import uvloop


class Upstream(asyncio.Protocol):
    """The relay's connection to the upstream: answers go back to ``client``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.out: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.out.append(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.client.writelines(self.out)
        self.out = []


class Relay(asyncio.Protocol):
    """One client connection: each request parsed, then sent upstream whole."""

    def __init__(self, loop, port: int) -> None:
        self.loop, self.port = loop, port
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None
        self.up: Upstream | None = None
        self.head: list[bytes] = []
        self.body: list[bytes] = []
        self.url = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head.append(b"%s: %s\r\n" % (name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        data = [b"%s %s HTTP/1.1\r\n" % (method, self.url), *self.head, b"\r\n", *self.body]
        self.head, self.body = [], []
        if self.up is None:
            self.loop.create_task(self._connect(data))
        else:
            self.up.transport.writelines(data)

    async def _connect(self, data: list[bytes]) -> None:
        _, self.up = await self.loop.create_connection(Upstream, "127.0.0.1", self.port)
        self.up.client = self.transport
        self.up.transport.writelines(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", type=int, required=True)
    args = ap.parse_args()
    uvloop.install()
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(
        lambda: Relay(loop, args.upstream), "127.0.0.1", args.port))
    try:
        loop.run_forever()
    finally:
        server.close()


if __name__ == "__main__":
    main()
