"""Names the cluster uses in NATS (DESIGN.md "Cluster").

* KV bucket ``ggmux-nodes``: one key per node, the node's name, whose value
  is its heartbeat record (JSON), rewritten every ``--heartbeat``.
* KV bucket ``ggmux-loads``: key ``load.<model>`` while one node loads the
  model for the cluster (JSON: model, target node, placing node, progress).
* Subject ``ggmux.node.<name>.cmd``: request-reply commands to one node.

Model names may hold characters that NATS keys do not allow (``:`` in
``org/repo:Q4_K_M``), so a key spells each byte outside ``[A-Za-z0-9_-]``
as ``=XX`` (hex); :func:`model_from_key` reverses it. Node names are
subject tokens and key names at once, so they are limited to
``[A-Za-z0-9_-]``, 1-64 characters (:func:`check_node_name`).
"""

from __future__ import annotations

import re
import socket

NODES_BUCKET = "ggmux-nodes"
LOADS_BUCKET = "ggmux-loads"
LOAD_PREFIX = "load."

_NODE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def check_node_name(name: str) -> str:
    """``name`` if it is a valid node name; ``ValueError`` naming the rule."""
    if not _NODE_RE.fullmatch(name):
        raise ValueError(f"--node-name {name!r}: use 1-64 of A-Z a-z 0-9 _ - (it is a NATS "
                         "subject token and key)")
    return name


def default_node_name() -> str:
    """The host name with characters a node name may not hold made ``-``."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:64]
    return name or "node"


def cmd_subject(node: str) -> str:
    """Subject of request-reply commands to ``node``."""
    return f"ggmux.node.{node}.cmd"


def load_key(model: str) -> str:
    """Key of ``model``'s cluster-wide load in ``ggmux-loads``."""
    out = []
    for b in model.encode():
        out.append(chr(b) if b in _PLAIN else f"={b:02X}")
    return LOAD_PREFIX + "".join(out)


def model_from_key(key: str) -> str:
    """Model name of a ``ggmux-loads`` key (inverse of :func:`load_key`);
    ``ValueError`` for a key that is not one."""
    if not key.startswith(LOAD_PREFIX):
        raise ValueError(f"not a load key: {key!r}")
    s = key[len(LOAD_PREFIX):]
    out = bytearray()
    i = 0
    while i < len(s):
        if s[i] == "=":
            out.append(int(s[i + 1:i + 3], 16))
            i += 3
        else:
            out += s[i].encode()
            i += 1
    return out.decode()
