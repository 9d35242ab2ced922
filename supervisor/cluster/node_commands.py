"""The cluster agent's commands between nodes (request-reply on
``ggmux.node.<name>.cmd``), the half of :class:`~.agent.Agent` that carries
them: ``request`` sends one to another node and reports the answer
(``reply``); a command that arrives is handed to the supervisor as an
``order`` line and answered with the supervisor's ``ack`` (``ping`` is
answered here). A mixin: the :class:`~.agent.Agent` holds the state (``o``
its options, ``connected``, ``nc``, ``acks``: order id -> future,
``order_id``)."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from ...instance import protocol
from .names import cmd_subject


class NodeCommands:
    """``request``, ``ack`` and the commands that arrive (module docstring)."""

    async def cmd_request(self, ref: int, node: str, op: str, **payload) -> None:
        """Send command ``op`` to ``node``; answer ``reply`` (ok, error, ...)."""
        if not self.connected:
            protocol.emit("reply", ref=ref, node=node, op=op, ok=False, error="NATS unreachable")
            return
        body = orjson.dumps({"op": op, "from": self.o.node, **payload})
        try:
            msg = await self.nc.request(cmd_subject(node), body, timeout=2 * self.o.heartbeat)
            answer = orjson.loads(msg.data)
            if not isinstance(answer, dict):
                raise TypeError("answer is not an object")
        except NoRespondersError:
            answer = {"ok": False, "error": f"node {node} does not listen"}
        except (TimeoutError, NatsTimeoutError):
            answer = {"ok": False,
                      "error": f"node {node} did not answer in {2 * self.o.heartbeat:g} s"}
        except (NatsError, ValueError, TypeError) as e:
            answer = {"ok": False, "error": str(e) or type(e).__name__}
        for k in ("state", "ref", "node", "op"):
            answer.pop(k, None)
        protocol.emit("reply", ref=ref, node=node, op=op, **answer)

    def cmd_ack(self, id: int, **answer) -> None:
        """The supervisor's answer to ``order`` ``id`` (``ok``, ``error``, more)."""
        fut = self.acks.get(id)
        if fut is not None and not fut.done():
            fut.set_result(answer)

    async def _on_command(self, msg) -> None:
        try:
            body = orjson.loads(msg.data)
            op = body.pop("op")
            if not isinstance(op, str):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            answer = {"ok": False, "error": "bad command"}
        else:
            if op == "ping":
                answer = {"ok": True}
            else:
                self.order_id += 1
                oid = self.order_id
                fut = asyncio.get_running_loop().create_future()
                self.acks[oid] = fut
                body.pop("state", None)
                body.pop("id", None)
                protocol.emit("order", id=oid, op=op, **body)
                try:
                    answer = await asyncio.wait_for(fut, self.o.heartbeat)
                except TimeoutError:
                    answer = {"ok": False,
                              "error": f"node {self.o.node}'s supervisor did not answer"}
                finally:
                    self.acks.pop(oid, None)
        if msg.reply:
            with contextlib.suppress(NatsError):
                await msg.respond(orjson.dumps({"node": self.o.node, **answer}))
