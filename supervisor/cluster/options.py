"""``ggmux serve --cluster ...``: the cluster's options, checked at start.

Every check raises ``ValueError`` whose text names the option at fault, so
``ggmux serve`` can stop with one clear line (issue 13: "a bad ``--cluster``
URL or bad credentials: a clear error at start naming the option"). Bad
credentials only show when NATS answers; the agent reports those and the
supervisor stops with the same kind of line.

NATS credentials come from the URL (``nats://USER:PASSWORD@HOST:PORT``,
``nats://TOKEN@HOST:PORT``) or from ``--nats-user``/``--nats-password``,
``--nats-token``, ``--nats-creds`` (a ``.creds`` file: JWT and NKey), not
both; ``tls://`` turns TLS on (``--nats-tls-ca`` names a CA file).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from .names import check_node_name, default_node_name

DEFAULT_NATS_PORT = 4222


@dataclass(slots=True)
class ClusterOptions:
    """What the supervisor and its cluster agent need to join a cluster.

    ``url``: NATS server URL (credentials still in it, never logged: see
    :func:`redact`); ``node``: this node's name; ``advertise``: the URL
    other nodes forward requests to (this node's public port);
    ``cluster_token``: secret that forwarded requests carry (empty: none);
    ``heartbeat``: seconds between beats; ``node_stale``: seconds after the
    last beat *arrived* at which a node is dead to the others.
    """

    url: str
    node: str
    advertise: str
    cluster_token: str = ""
    heartbeat: float = 2.0
    node_stale: float = 6.0
    user: str = ""
    password: str = ""
    token: str = ""
    creds: str = ""
    tls_ca: str = ""

    def agent_config(self) -> dict:
        """The JSON object the agent reads as its first stdin line (secrets
        travel on the pipe, never on a command line or in the environment)."""
        d = asdict(self)
        d.pop("cluster_token")
        return d


def redact(url: str) -> str:
    """``url`` with any password or token replaced by ``***``."""
    u = urlsplit(url)
    if not (u.username or u.password):
        return url
    host = u.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"***@{host}" if u.password is None else f"{u.username}:***@{host}"
    if u.port:
        netloc += f":{u.port}"
    return u._replace(netloc=netloc).geturl()


def add_cluster_options(ap: argparse.ArgumentParser) -> None:
    """Add the ``--cluster`` group of options to ``ggmux serve``."""
    g = ap.add_argument_group("cluster (needs nats-py: pip install nats-py, or "
                              "pip install -e '.[cluster]' in ggmux's checkout)")
    g.add_argument("--cluster", default=None, metavar="URL",
                   help="join the cluster that coordinates through the NATS JetStream server at "
                        "URL (nats://HOST:PORT or tls://HOST:PORT; credentials may be in it)")
    g.add_argument("--node-name", default=None, metavar="NAME",
                   help="this node's name (A-Z a-z 0-9 _ -) in the cluster, and in the usage ledger's node "
                        "column (also without --cluster: servers that share a ledger need "
                        "names of their own for --ledger-sync) (default: the host name)")
    g.add_argument("--advertise", default=None, metavar="URL",
                   help="http://HOST:PORT where other nodes reach this node's port (default: "
                        "--host and --port, the host name when --host is a wildcard)")
    g.add_argument("--cluster-token", default=None, metavar="TOKEN",
                   help="secret that requests forwarded between nodes carry; a node trusts the "
                        "hop header only with it (default: $GGMUX_CLUSTER_TOKEN)")
    g.add_argument("--heartbeat", type=float, default=2.0, metavar="S",
                   help="seconds between this node's beats in the node registry")
    g.add_argument("--node-stale", type=float, default=6.0, metavar="S",
                   help="a node whose last beat arrived this many seconds ago is dead to this one")
    g.add_argument("--nats-user", default=None, metavar="USER", help="NATS user (or give it in the URL)")
    g.add_argument("--nats-password", default=None, metavar="PASSWORD",
                   help="NATS password (default: $GGMUX_NATS_PASSWORD)")
    g.add_argument("--nats-token", default=None, metavar="TOKEN",
                   help="NATS authentication token (default: $GGMUX_NATS_TOKEN)")
    g.add_argument("--nats-creds", default=None, metavar="FILE",
                   help="NATS credentials file (JWT and NKey seed)")
    g.add_argument("--nats-tls-ca", default=None, metavar="FILE",
                   help="CA certificate file for a tls:// NATS server")


def _default_advertise(host: str, port: int) -> str:
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = host == ""
    if wildcard:
        host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def check_url(url: str) -> None:
    """``ValueError`` naming ``--cluster`` unless ``url`` is a usable NATS URL."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:
        raise ValueError(f"--cluster {redact(url)!r}: {e}") from None
    if u.scheme not in ("nats", "tls"):
        raise ValueError(f"--cluster {redact(url)!r}: use nats://HOST:PORT or tls://HOST:PORT")
    if not u.hostname:
        raise ValueError(f"--cluster {redact(url)!r}: no host")
    if u.path not in ("", "/") or u.query or u.fragment:
        raise ValueError(f"--cluster {redact(url)!r}: no path or query after HOST:PORT")
    if port == 0:
        raise ValueError(f"--cluster {redact(url)!r}: port must be 1-65535")


def from_args(args: argparse.Namespace) -> ClusterOptions | None:
    """:class:`ClusterOptions` from ``ggmux serve``'s arguments, ``None``
    without ``--cluster``. Raises ``ValueError`` naming the bad option."""
    if not args.cluster:
        return None
    url = args.cluster.strip()
    # secrets may come from the environment (never shown by --help)
    for opt, var in (("cluster_token", "GGMUX_CLUSTER_TOKEN"), ("nats_password",
                     "GGMUX_NATS_PASSWORD"), ("nats_token", "GGMUX_NATS_TOKEN")):
        if not getattr(args, opt, None) and os.environ.get(var):
            setattr(args, opt, os.environ[var])
    check_url(url)
    u = urlsplit(url)
    if u.port is None:
        url = f"{url.rstrip('/')}:{DEFAULT_NATS_PORT}"
    if (u.username or u.password) and (args.nats_user or args.nats_password or args.nats_token
                                       or args.nats_creds):
        raise ValueError("give the NATS credentials in the --cluster URL or in --nats-user/"
                         "--nats-password/--nats-token/--nats-creds, not both")
    if bool(args.nats_user) != bool(args.nats_password):
        raise ValueError("--nats-user and --nats-password go together")
    if args.nats_token and args.nats_user:
        raise ValueError("--nats-token or --nats-user/--nats-password, not both")
    for opt, path in (("--nats-creds", args.nats_creds), ("--nats-tls-ca", args.nats_tls_ca)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{opt} {path}: no such file")
    if args.nats_tls_ca and u.scheme != "tls":
        raise ValueError("--nats-tls-ca needs a tls:// --cluster URL")
    node = check_node_name(args.node_name) if args.node_name else default_node_name()
    if not args.heartbeat > 0:
        raise ValueError(f"--heartbeat must be above 0, not {args.heartbeat:g}")
    if not args.node_stale > args.heartbeat:
        raise ValueError(f"--node-stale ({args.node_stale:g} s) must be longer than --heartbeat "
                         f"({args.heartbeat:g} s), else live nodes look dead")
    advertise = args.advertise or _default_advertise(args.host, args.port)
    a = urlsplit(advertise)
    try:
        a_port = a.port
    except ValueError:
        a_port = None
    if a.scheme != "http" or not a.hostname or not a_port or a.path not in ("", "/"):
        raise ValueError(f"--advertise {advertise!r}: use http://HOST:PORT")
    return ClusterOptions(
        url=url, node=node, advertise=advertise.rstrip("/"),
        cluster_token=args.cluster_token or "", heartbeat=args.heartbeat,
        node_stale=args.node_stale, user=args.nats_user or "", password=args.nats_password or "",
        token=args.nats_token or "", creds=args.nats_creds or "", tls_ca=args.nats_tls_ca or "",
    )
