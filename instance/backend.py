"""What an instance serves: the :class:`Backend` base class.

Its own module so that ``instance/`` has no import circle: the server
(:mod:`ggmux.instance.server`) imports the backends (:mod:`.llama`,
:mod:`.fake`), and the backends import this base, never the server.
"""

from __future__ import annotations

from collections.abc import Callable

from .validate import BadRequest

Sink = Callable[[str, object], None]
"""``sink(kind, payload)`` of one request, callable from any thread:
``("chunk", dict)`` a streamed OpenAI chunk, ``("result", dict)`` a whole
answer, ``("end", usage)`` the stream ended cleanly (its OpenAI ``usage``
object, or None), ``("error", str)`` it
failed (a stop; a :class:`ReplicaFault`, a str too, for a decode error);
nothing follows ``result``, ``end`` or
``error``."""


class ReplicaFault(RuntimeError):
    """The instance itself failed, whatever the request (a broken context,
    a decode error): answered 500 marked ``fault``, so the replica's circuit
    counts it (issue 11)."""


class Backend:
    """A model behind an instance. ``slots``: requests it serves at once
    (reported in the ``ready`` line; the balancer counts in-flight relative
    to it). Calls other than :meth:`start` are quick or run on a worker
    thread of the server; :meth:`start` returns at once and answers through
    its sink."""

    name: str = "model"
    slots: int = 1

    def load(self) -> dict:
        """Load the model; return the ``ready`` payload (``n_ctx``,
        ``effective``, ``slots``)."""
        raise NotImplementedError

    def use_loop(self, loop) -> None:
        """The server's asyncio ``loop``: a backend may run its requests'
        sinks on that loop's thread (sinks stay callable from any thread).
        The built-in engine hands each step's events of all requests there
        in one ``call_soon_threadsafe`` (issue 21)."""

    def measure(self) -> dict:
        """Memory a load needs (``--measure``): ``{"min": {device: bytes},
        "max": {...}}``."""
        return {"min": {}, "max": {}}

    def start(self, kind: str, body: dict, sink: Sink, request_id: str = "",
              tenant: str = "") -> Callable[[], None]:
        """Begin one ``kind`` request (``chat``, ``completion``,
        ``embedding``) with a JSON ``body`` (``request_id`` is shown in
        ``/slots``; ``tenant``, the proxy's ``x-ggmux-tenant``, decides its
        turn for a slot and whose prompt cache it may reuse): checks it (raises
        :class:`~ggmux.instance.validate.BadRequest` at once), queues it, and
        returns ``cancel()`` (any thread), which ends it at the next step
        (the client left). Its answer goes to ``sink``."""
        raise NotImplementedError

    def tokenize(self, body: dict) -> dict:
        """llama.cpp ``/tokenize``: ``{"content", "add_special"}`` -> ``{"tokens"}``."""
        raise BadRequest("tokenize is not supported by this backend")

    def detokenize(self, body: dict) -> dict:
        """llama.cpp ``/detokenize``: ``{"tokens"}`` -> ``{"content"}``."""
        raise BadRequest("detokenize is not supported by this backend")

    def apply_template(self, body: dict) -> dict:
        """llama-server's ``/apply-template``: a chat-completions body
        (``messages``, ``tools``, ...) -> ``{"prompt": rendered text}``."""
        raise BadRequest("apply-template is not supported by this backend")

    def input_tokens(self, body: dict) -> dict:
        """llama-server's ``/chat/completions/input_tokens``: a
        chat-completions body -> ``{"input_tokens": n}``, the tokens of its
        rendered prompt (:meth:`apply_template`, then :meth:`tokenize` with
        special tokens, as ``handle_count_tokens`` counts them)."""
        prompt = self.apply_template(body)["prompt"]
        return {"input_tokens": len(self.tokenize({"content": prompt,
                                                   "add_special": True})["tokens"])}

    def props(self) -> dict:
        """llama.cpp ``/props``-like facts about the loaded model."""
        return {"model_alias": self.name, "total_slots": self.slots}

    def slot_info(self) -> list[dict]:
        """llama.cpp ``/slots``: one dict per slot (``id``, ``is_processing`` ...)."""
        return [{"id": i, "is_processing": False} for i in range(self.slots)]

    def metrics(self) -> dict:
        """Counters and gauges for the instance's ``/metrics`` (names without
        prefix -> number): ``requests_processing``, ``requests_deferred``,
        token counts and seconds, ``kv_used``/``kv_size``..."""
        return {}

    def cache_info(self) -> dict | None:
        """``GET /cache`` of the KV tiers (issue 29): ``{"ram": {"entries",
        "bytes", "limit_bytes"}, "disk": {..., "dir"}, "hits": {"slot", "ram",
        "disk"}, "misses", "restored_tokens", "restore_seconds", "saved",
        "rejected"}``; None when the backend has no tiers (answered 404)."""
        return None

    def cache_clear(self) -> dict:
        """``POST /cache/clear``: empty the RAM and disk tiers;
        ``{"cleared": {"ram": entries, "disk": entries}}``."""
        return {"cleared": {"ram": 0, "disk": 0}}

    def sleep(self) -> None:
        """Free the weights, keep the process (``--sleep-idle-seconds``);
        waits for the requests in progress."""

    def wake(self) -> dict:
        """Reload the weights after :meth:`sleep`; the ``ready`` payload."""
        return self.load()

    def refuse_queued(self, reason: str) -> None:
        """Requests not started yet end with ``("error", reason)``; running
        ones go on (the first step of a stop)."""

    def close(self, reason: str) -> None:
        """Stop: every queued and running request ends with ``("error",
        reason)``; nothing more is served."""
