"""The targets of :mod:`bench.compare` and how each is started: ``direct``
(one instance, or the fake server), ``nginx`` in front of it, ``ggmux
serve`` and llama.cpp's router (:data:`STARTERS`), each serving the demo
models; :func:`first_token`, the one streamed request that loads a model
(and times a cold switch).
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import llama_server
from bench.processes import remove_ggmux_ipc
from bench.serving import BenchConfig, run
from bench.targets import Context, Target, TargetError, free_port, http_request, wait_ready

HOT_MODEL = "smollm2-135m"
DEMO_MODELS = ("smollm2-135m", "gemma3-270m")
ALL_TARGETS = ("direct", "nginx", "ggmux", "llama-router")
CTX_SIZE = 2048

DIRECT_CMD = (
    "{python} -m ggmux.instance --model {model_path} --name {model} "
    "--host 127.0.0.1 --port {port} --ctx-size " + str(CTX_SIZE)
)
GGMUX_SERVE_ARGS = "serve --host 127.0.0.1 --port {port} --models-max 2 --proxies 2"
FAKE_CMD = (
    "{python} -m bench.fake_openai --port {port} --models "
    + ",".join(DEMO_MODELS)
    + " --ttft 0.02 --token-delay 0.005 --load-delay 0.5"
)


def _format_cmd(template: str, **values: Any) -> list[str]:
    return [part.format(**values) for part in shlex.split(template)]


def start_direct(ctx: Context) -> Target:
    """One instance serving :data:`HOT_MODEL` (or the fake server with ``--fake``)."""
    port = free_port()
    proc = ctx.procs.spawn("direct", direct_cmd(ctx, HOT_MODEL, port), env=ctx.env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", "/health", proc, ctx.args.start_timeout)
    except TargetError as exc:
        raise TargetError(f"{exc}\n{ctx.procs.log_tail('direct')}") from None
    ctx.direct_port = port
    note = "fake server (--fake)" if ctx.args.fake else ""
    return Target(
        "direct",
        f"http://127.0.0.1:{port}",
        can_unload=ctx.args.fake,
        note=note,
        processes=("direct",),
    )


def direct_cmd(ctx: Context, model: str, port: int) -> list[str]:
    template = FAKE_CMD if ctx.args.fake else ctx.args.direct_cmd
    path = ctx.model_paths.get(model, Path(model))
    return _format_cmd(template, python=ctx.args.python, model=model, model_path=path, port=port)


NGINX_CONF = """\
{user}worker_processes {workers};
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream instance {{
        server 127.0.0.1:{upstream};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://instance;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def first_token(base_url: str, model: str, template: BenchConfig) -> dict[str, Any]:
    """One streamed completion from ``model``; returns its record (``ttft`` in seconds).

    Always ``/v1/completions``: the demo Gemma 3 270M is a base model without
    a chat template, and answers a chat request with no content at all.
    """
    result = run(
        replace(
            template,
            endpoint="completions",
            base_url=base_url,
            models=[(model, 1.0)],
            requests=1,
            rate=math.inf,
            max_tokens=(4, 4),
            prompt_words=(4, 4),
            stream=True,
            warmup=0,
            progress=False,
        )
    )
    return result["requests"][0]


def pick_cheap_path(ctx: Context, base_url: str, candidates: Sequence[str]) -> tuple[str, str]:
    """Load :data:`HOT_MODEL` with one request, then the first of ``candidates`` answering 200.

    Returns ``(path, note)``; the note says what the path measures. Raises
    ``TargetError`` when the model does not answer.
    """
    template = BenchConfig(endpoint=ctx.args.endpoint, timeout=ctx.args.start_timeout)
    record = first_token(base_url, HOT_MODEL, template)
    if record["error"]:
        raise TargetError(f"first request to {HOT_MODEL} failed: {record['error']}")
    for path in candidates:
        with contextlib.suppress(OSError):
            if http_request(base_url, "GET", path)[0] == 200:
                if path == "/health":
                    return path, "cheap GET is its own /health (not forwarded to an instance)"
                return path, f"cheap GET is {path}"
    return candidates[-1], f"no candidate GET answered 200: {list(candidates)}"


def start_nginx(ctx: Context) -> Target:
    """nginx proxying to the direct instance with upstream keepalive."""
    nginx = ctx.args.nginx or shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise TargetError("nginx is not installed (apt-get install nginx, or --nginx PATH)")
    if ctx.direct_port is None:
        raise TargetError("nginx proxies to the direct target, which is not running")
    tmp = ctx.procs.workdir / "nginx"
    tmp.mkdir(exist_ok=True)
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            user="user root;\n" if os.geteuid() == 0 else "",  # workers may write tmp
            workers=ctx.args.proxies,
            tmp=tmp,
            upstream=ctx.direct_port,
            port=port,
        )
    )
    proc = ctx.procs.spawn("nginx", [nginx, "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"])
    try:
        wait_ready(f"http://127.0.0.1:{port}", "/health", proc, 20.0)
    except TargetError as exc:
        raise TargetError(f"{exc}\n{ctx.procs.log_tail('nginx')}") from None
    return Target(
        "nginx",
        f"http://127.0.0.1:{port}",
        note=f"nginx, {ctx.args.proxies} workers, in front of the direct instance",
        processes=("nginx", "direct"),
    )


def start_ggmux(ctx: Context) -> Target:
    """``ggmux serve`` with the demo models; ready when ``GET /health`` is 200."""
    port = free_port()
    if ctx.args.ggmux_cmd:
        cmd = _format_cmd(ctx.args.ggmux_cmd, python=ctx.args.python, port=port)
    else:
        exe = shutil.which("ggmux", path=str(Path(ctx.args.python).parent)) or shutil.which("ggmux")
        launcher = (
            [exe]
            if exe
            else [
                ctx.args.python,
                "-c",
                "import sys; from ggmux.supervisor.cli import main; sys.exit(main())",
            ]
        )
        cmd = [*launcher, *_format_cmd(GGMUX_SERVE_ARGS, port=port)]
        cmd[cmd.index("--proxies") + 1] = str(ctx.args.proxies)
    proc = ctx.procs.spawn("ggmux", cmd, env=ctx.env, cleanup=lambda: remove_ggmux_ipc(port))
    try:
        wait_ready(f"http://127.0.0.1:{port}", "/health", proc, ctx.args.start_timeout)
    except TargetError as exc:
        raise TargetError(f"{exc}\n{ctx.procs.log_tail('ggmux')}") from None
    base_url = f"http://127.0.0.1:{port}"
    cheap_path, note = pick_cheap_path(ctx, base_url, [f"/upstream/{HOT_MODEL}/health", "/health"])
    return Target(
        "ggmux", base_url, cheap_path=cheap_path, can_unload=True, note=note, processes=("ggmux",)
    )


def start_llama_router(ctx: Context) -> Target:
    """llama.cpp's ``llama-server`` in router mode over a preset of the demo models."""
    binary = llama_server.find(ctx.args.llama_server)
    if binary is None:
        raise TargetError(
            f"{ctx.args.llama_server} is not a file"
            if ctx.args.llama_server
            else f"llama-server not found: {llama_server.HOW_TO_GET}"
        )
    tmp = ctx.procs.workdir / "llama-router"
    (tmp / "cache").mkdir(parents=True, exist_ok=True)
    preset = tmp / "models.ini"
    sections = "".join(
        f"\n[{name}]\nmodel = {ctx.model_paths[name]}\n"
        for name in DEMO_MODELS
        if name in ctx.model_paths
    )
    preset.write_text(f"version = 1\n\n[*]\nc = {CTX_SIZE}\n{sections}")
    port = free_port()
    cmd = [
        str(binary),
        "--models-preset",
        str(preset),
        "--models-max",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *shlex.split(ctx.args.llama_server_args),
    ]
    env = dict(os.environ, LLAMA_CACHE=str(tmp / "cache"))  # no cached models listed
    proc = ctx.procs.spawn("llama-router", cmd, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, "/health", proc, ctx.args.start_timeout)
    except TargetError as exc:
        raise TargetError(f"{exc}\n{ctx.procs.log_tail('llama-router')}") from None
    cheap_path, note = pick_cheap_path(ctx, base_url, [f"/props?model={HOT_MODEL}", "/health"])
    return Target(
        "llama-router",
        base_url,
        cheap_path=cheap_path,
        can_unload=True,
        note=f"llama-server router ({ctx.args.llama_server_args}); {note}",
        processes=("llama-router",),
    )


STARTERS: dict[str, Callable[[Context], Target]] = {
    "direct": start_direct,
    "nginx": start_nginx,
    "ggmux": start_ggmux,
    "llama-router": start_llama_router,
}
