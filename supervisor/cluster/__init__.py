"""Cluster mode (DESIGN.md "Cluster"): nodes that share one model pool
through NATS JetStream.

* :mod:`.names`: bucket, key and subject names, node-name rules (no NATS).
* :mod:`.options`: ``--cluster`` URL and credentials, checked at start (no NATS).
* :mod:`.agent`: the cluster agent, a child process of the supervisor that
  alone imports ``nats``; it speaks the instance line protocol.
* :mod:`.nats_io`: the agent's NATS plumbing (connect, buckets, conditional
  writes with a TTL).

Nothing here imports ``nats`` unless ``ggmux serve --cluster`` starts the
agent, so single-node mode needs no NATS package at all.
"""
