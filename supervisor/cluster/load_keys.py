"""The cluster agent's orders about load keys (KV ``ggmux-loads``), the
half of :class:`~.agent.Agent` that makes one load per model cluster-wide:
``claim`` creates ``load.<model>`` naming the target node (the create fails
when a load is on already, and the answer says who holds it); ``hold``
makes this node the holder, renewing the key every beat with the load's
progress while the supervisor says it goes on; ``release`` deletes it once
the load is over. A mixin: the :class:`~.agent.Agent` holds the state
(``o`` its options, ``connected``, ``js``, ``loads``: model -> (revision,
value) of the keys seen, ``holding``: model -> progress, ``wake_beat``) and
``_put`` / ``_beat``."""

from __future__ import annotations

import contextlib
import time

import orjson
from nats.errors import Error as NatsError
from nats.js.errors import APIError

from ...instance import protocol
from .names import LOADS_BUCKET, load_key
from .nats_io import Taken


class LoadKeys:
    """``claim``, ``hold``, ``release`` (module docstring)."""

    async def cmd_claim(self, model: str, node: str, ref: int = 0) -> None:
        """Create ``load.<model>`` naming target ``node``; answer ``claimed``."""
        if not self.connected:
            protocol.emit("claimed", ref=ref, model=model, ok=False, holder=None,
                          error="NATS unreachable")
            return
        value = {"model": model, "node": node, "by": self.o.node, "progress": 0.0,
                 "state": "placing", "since": time.time()}
        try:
            rev = await self._put(LOADS_BUCKET, load_key(model), orjson.dumps(value), 0)
        except Taken as t:
            protocol.emit("claimed", ref=ref, model=model, ok=False, holder=t.value.get("node"),
                          entry=t.value)
            return
        except (TimeoutError, NatsError, APIError) as e:
            protocol.emit("claimed", ref=ref, model=model, ok=False, holder=None,
                          error=str(e) or type(e).__name__)
            return
        self.loads[model] = (rev, value)
        protocol.emit("claimed", ref=ref, model=model, ok=True, holder=node, entry=value)

    async def cmd_hold(self, model: str, progress: float = 0.0) -> None:
        """This node loads ``model`` for the cluster: renew its load key
        every beat with ``progress`` (0-1) until ``release``."""
        self.holding[model] = float(progress)
        if self.connected:
            await self._renew(model)

    async def cmd_release(self, model: str) -> None:
        """The load of ``model`` is over (ready or failed): delete its key if
        this node holds it or placed it."""
        self.holding.pop(model, None)
        rev, value = self.loads.get(model, (0, {}))
        if not self.connected or not value:
            return
        # the record that shows the model loaded goes out before its load key
        # goes, so no node sees neither and places the model a second time
        self.wake_beat = False
        await self._beat()
        if self.o.node not in (value.get("node"), value.get("by")):
            return
        kv = await self.js.key_value(LOADS_BUCKET)
        with contextlib.suppress(APIError):
            await kv.delete(load_key(model), last=rev)

    async def _renew(self, model: str) -> None:
        rev, value = self.loads.get(model, (0, {}))
        if value and value.get("node") != self.o.node:
            self.holding.pop(model, None)
            protocol.emit("lost", model=model, holder=value.get("node"))
            return
        new = {"model": model, "node": self.o.node, "by": value.get("by", self.o.node),
               "progress": self.holding.get(model, 0.0), "state": "loading",
               "since": value.get("since", time.time())}
        for _ in range(2):
            try:
                rev = await self._put(LOADS_BUCKET, load_key(model), orjson.dumps(new), rev)
                self.loads[model] = (rev, new)
                return
            except Taken as t:
                if t.value.get("node") == self.o.node:
                    rev = t.seq
                    new["by"] = t.value.get("by", new["by"])
                    continue
                self.holding.pop(model, None)
                protocol.emit("lost", model=model, holder=t.value.get("node"))
                return
