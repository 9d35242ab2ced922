"""The container: the Dockerfile and compose file say what they must
(checked on the files: stages, a non-root user, the models volume, the
certificates of a TLS-intercepting proxy before the first pip, pip's cache
mount, the CUDA variant's build arguments, the cluster profile's token),
and, where an image builder and the base image are at hand and
``GGMUX_TEST_CONTAINER=1`` asks for it, the image is built and run: it
serves as a non-root user, answers /health, passes its own HEALTHCHECK,
reads its options from ``GGMUX_*`` and stops on SIGTERM.

The build is opt-in because it takes a minute once the build's pip cache
mount holds llama-cpp-python's wheel and a quarter of an hour (more on busy
cores) the first time; on a 2-core machine shared by a test suite that must
stay under ten minutes it cannot run every time. With ``$PIP_CERT`` naming
a file (a TLS-intercepting proxy's bundle) the build context is a copy of
the repository with it in ``certs/``, as README says to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import free_port, wait_for
from manual import manual

ROOT = Path(__file__).resolve().parent.parent
README_CMAKE = re.search(r'CMAKE_ARGS="([^"]+)"', (ROOT / "README.md").read_text()).group(1)


def test_the_dockerfile_builds_in_stages_and_runs_non_root_with_a_models_volume():
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) == 2 and " AS build" in text
    assert f'CMAKE_ARGS="{README_CMAKE}"' in text  # README's flags: no -march=native
    assert re.search(r"^USER ggmux$", text, re.MULTILINE) and "--uid 10001" in text
    assert 'VOLUME ["/models"]' in text and "GGMUX_MODELS_DIR=/models" in text
    assert "GGMUX_HOST=0.0.0.0" in text and "EXPOSE 8080" in text
    hc = re.search(r"^HEALTHCHECK .*?CMD (.*)$", text, re.MULTILINE | re.DOTALL).group(1)
    assert "/health" in hc
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.MULTILINE)
    assert 'ENTRYPOINT ["tini", "--", "ggmux"]' in text and 'CMD ["serve"]' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def instructions(text: str) -> list[tuple[str, str]]:
    """The Dockerfile's instructions as ``(KEYWORD, arguments)``, comments
    dropped and continuation lines joined."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        kw, _, rest = cur.strip().partition(" ")
        out.append((kw.upper(), " ".join(rest.split())))
        cur = ""
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    """The instructions of each ``FROM`` stage, its ``FROM`` first."""
    out: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def test_the_build_trusts_certs_before_the_first_pip_and_caches_pip():
    """A TLS-intercepting proxy's CA (certs/*.crt) is trusted before any pip
    runs (a build argument naming a file cannot be: nothing is copied in
    yet), and every pip of the build stage keeps pip's cache in a cache
    mount, so a rebuild does not compile llama-cpp-python again."""
    build, runtime = stages((ROOT / "Dockerfile").read_text())
    pips = [i for i, (kw, a) in enumerate(build) if kw == "RUN" and "pip " in a]
    certs = [i for i, (kw, a) in enumerate(build) if kw == "COPY" and a.startswith("certs/ ")]
    trust = [i for i, (kw, a) in enumerate(build)
             if kw == "RUN" and "update-ca-certificates" in a]
    assert pips and certs and trust and certs[0] < trust[0] < pips[0], build
    assert ("ENV", "PIP_CERT=/etc/ssl/certs/ca-certificates.crt") in build[:pips[0]]
    assert not any(kw == "ARG" and a.startswith("PIP_CERT") for kw, a in build)
    for i in pips:
        assert build[i][1].startswith("--mount=type=cache,target=/root/.cache/pip "), build[i]
    assert (ROOT / "certs").is_dir()  # COPY certs/ needs it, empty or not
    assert "certs" not in (ROOT / ".dockerignore").read_text().split()
    # the runtime stage installs only the wheels: no network, no certificates
    assert any("--no-index" in a for kw, a in runtime if kw == "RUN")


def test_the_cuda_variant_is_build_arguments_on_an_nvidia_cuda_base():
    """BASE and RUNTIME_BASE choose both stages' images and CMAKE_ARGS
    llama.cpp's backend; the recipe in the Dockerfile and README builds
    with GGML_CUDA on nvidia/cuda's devel and runtime images."""
    text = (ROOT / "Dockerfile").read_text()
    top = [ins for ins in instructions(text)[:3] if ins[0] == "ARG"]
    assert ("ARG", "BASE=debian:bookworm-slim") in top
    assert ("ARG", "RUNTIME_BASE=debian:bookworm-slim") in top
    build, runtime = stages(text)
    assert build[0] == ("FROM", "${BASE} AS build") and runtime[0] == ("FROM", "${RUNTIME_BASE}")
    assert any(kw == "ARG" and a.startswith("CMAKE_ARGS=") for kw, a in build)
    for doc in (text, manual()):
        recipe = re.search(r"build --build-arg BASE=nvidia/cuda:(\S+)-devel-(\S+) .*?"
                           r"RUNTIME_BASE=nvidia/cuda:(\S+)-runtime-(\S+) .*?"
                           r'CMAKE_ARGS="([^"]+)"', doc, re.DOTALL)
        assert recipe, "no CUDA recipe"
        cuda, distro, cuda_rt, distro_rt, cmake = recipe.groups()
        assert (cuda, distro) == (cuda_rt, distro_rt)  # one Python in both stages
        assert "-DGGML_CUDA=on" in cmake and "-DGGML_NATIVE=OFF" in cmake


def test_podman_builds_keep_the_healthcheck_with_the_docker_format():
    """OCI images have no HEALTHCHECK (podman drops it with a warning):
    README and the Dockerfile say to build with --format docker."""
    for doc in ((ROOT / "Dockerfile").read_text(), manual()):
        assert "podman build --format docker" in doc


def test_the_compose_file_runs_one_node_and_a_nats_cluster_profile():
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    svc = doc["services"]
    one = svc["ggmux"]
    assert one["build"] == "." and "8080:8080" in one["ports"]
    assert any(v.endswith(":/models:ro") for v in one["volumes"])
    assert one["stop_grace_period"] == "30s"
    assert set(svc) == {"ggmux", "nats", "node-a", "node-b"}
    assert "-js" in svc["nats"]["command"]
    for node in ("node-a", "node-b"):
        env = svc[node]["environment"]
        assert svc[node]["profiles"] == ["cluster"]
        assert env["GGMUX_CLUSTER"] == "nats://nats:4222" and env["GGMUX_NODE_NAME"] == node
        # the nodes' shared secret, from .env; "" (unset) is no token, never a
        # required ":?" that would stop the one-node profile's `up` as well
        assert env["GGMUX_CLUSTER_TOKEN"] == "${GGMUX_CLUSTER_TOKEN:-}"
    assert "GGMUX_CLUSTER_TOKEN" not in one["environment"]


# ---- build and run --------------------------------------------------------------------------
def _ok(*cmd: str) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _builder() -> str | None:
    if shutil.which("docker") and _ok("docker", "info"):
        return "docker"
    if shutil.which("podman"):
        return "podman"
    return None


@pytest.fixture
def image(tmp_path):
    if os.environ.get("GGMUX_TEST_CONTAINER") != "1":
        pytest.skip("set GGMUX_TEST_CONTAINER=1 to build and run the image (a minute or more)")
    builder = _builder()
    if builder is None:
        pytest.skip("no image builder (docker with a daemon, or podman)")
    base = os.environ.get("GGMUX_TEST_IMAGE_BASE", "debian:bookworm-slim")
    if not _ok(builder, "image", "inspect", base):
        pytest.skip(f"base image {base} is not here (no registry to pull it from); "
                    "set GGMUX_TEST_IMAGE_BASE")
    tag = f"ggmux-test:{os.getpid()}"
    cmd = [builder, "build", "--network", "host", "--build-arg", f"BASE={base}",
           "--build-arg", f"RUNTIME_BASE={base}", "-t", tag]
    if builder == "podman":
        # no OCI runtime needed to build; the docker format keeps HEALTHCHECK
        cmd += ["--isolation", "chroot", "--format", "docker"]
    context = ROOT
    cert = os.environ.get("PIP_CERT")
    if cert and Path(cert).is_file():  # a TLS-intercepting proxy: README's way, certs/
        context = tmp_path / "context"
        shutil.copytree(ROOT, context, ignore=shutil.ignore_patterns(
            *(ROOT / ".dockerignore").read_text().split()))
        shutil.copy(cert, context / "certs" / "build-proxy.crt")
    r = subprocess.run([*cmd, str(context)], capture_output=True, text=True, timeout=3600,
                       check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    yield builder, tag
    subprocess.run([builder, "rmi", "-f", tag], capture_output=True, timeout=120, check=False)


def _healthcheck(builder: str, tag: str) -> list[str]:
    """The image's HEALTHCHECK command (``Test`` without its ``CMD``); an
    OCI-format image has none."""
    if shutil.which("buildah") and builder == "podman":
        doc = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", tag],
                                        capture_output=True, text=True, check=True).stdout)
        hc = (doc.get("Docker", {}).get("config") or {}).get("Healthcheck")
    else:
        doc = json.loads(subprocess.run([builder, "image", "inspect", tag], capture_output=True,
                                        text=True, check=True).stdout)
        hc = (doc[0].get("Config") or {}).get("Healthcheck")
    assert hc and hc["Test"][0] == "CMD", f"the image has no HEALTHCHECK: {hc}"
    return hc["Test"][1:]


def _start(builder: str, tag: str, port: int, fakes: Path):
    """Run the image's entrypoint: ``(process, stop, cleanup)``, ``stop()``
    sending SIGTERM as a container stop does.
    podman's OCI runtime may be unusable inside another container: then the
    image runs through buildah's chroot isolation, entrypoint and user as
    the image says."""
    env = ["-e", f"GGMUX_PORT={port}", "-e", "GGMUX_MODELS_DIR=", "-e",
           "GGMUX_FAKE_MODELS_DIR=/srv/fakes", "-e", "GGMUX_PROXIES=1"]
    vol = ["-v", f"{fakes}:/srv/fakes:ro"]
    name = f"ggmux-test-{os.getpid()}"
    if builder == "docker" or _ok("podman", "run", "--rm", tag, "--version"):
        p = subprocess.Popen([builder, "run", "--rm", "--name", name, "--network", "host",
                              *env, *vol, tag], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
        if builder == "docker":  # the engine runs it on its interval: wait for "healthy"
            def healthy() -> bool:
                r = subprocess.run(["docker", "inspect", "--format", "{{.State.Health.Status}}",
                                    name], capture_output=True, text=True, check=False)
                return r.stdout.strip() == "healthy"
        else:
            def healthy() -> bool:
                return _ok("podman", "healthcheck", "run", name)
        return (p, lambda: _ok(builder, "stop", "-t", "30", name),
                lambda: _ok(builder, "rm", "-f", name), healthy)
    if not shutil.which("buildah"):
        pytest.skip("podman cannot run containers here and buildah is missing")
    ctr = subprocess.run(["buildah", "from", "--name", name, tag], capture_output=True,
                         text=True, check=True).stdout.strip()
    cfg = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", tag],
                                    capture_output=True, text=True, check=True).stdout)
    oci = cfg["OCIv1"]["config"]
    run = ["buildah", "run", "--isolation", "chroot", "--network", "host", "--user",
           oci["User"], *env, *vol, ctr, "--"]
    p = subprocess.Popen([*run, *oci["Entrypoint"], *oci["Cmd"]],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    check = _healthcheck(builder, tag)

    def healthy() -> bool:  # the HEALTHCHECK's command, run inside the container
        return subprocess.run([*run, *check], capture_output=True, timeout=60,
                              check=False).returncode == 0

    return p, lambda: _signal_tini(port), lambda: _ok("buildah", "rm", ctr), healthy


def _supervisor_uid(port: int) -> int | None:
    """The uid of the supervisor serving ``port`` (found by its process title)."""
    want = f"ggmux: supervisor 0.0.0.0:{port}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{d}/status").read_text()
        except OSError:
            continue
        if cmd[0].rstrip() == want:
            return int(re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE).group(1))
    return None


def test_the_image_serves_as_a_non_root_user_passes_its_healthcheck_and_stops_on_sigterm(
        image, tmp_path):
    builder, tag = image
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    (fakes / "alpha.json").write_text("{}")
    port = free_port()
    assert "/health" in " ".join(_healthcheck(builder, tag))  # kept: --format docker
    proc, stop, cleanup, healthy = _start(builder, tag, port, fakes)
    try:
        def health() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                              timeout=2).status == 200
            except OSError:
                return False

        wait_for(health, 120, 0.5, "the container's /health")
        wait_for(healthy, 120, 1, "the image's HEALTHCHECK to pass")
        doc = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))
        assert [m["id"] for m in doc["data"]] == ["alpha"]  # GGMUX_* reached serve
        uid = _supervisor_uid(port)
        assert uid is not None and uid != 0
        stop()
        proc.wait(60)
        assert b"INFO ggmux.supervisor: stopped" in proc.stdout.read()  # drained, not killed
    finally:
        if proc.poll() is None:  # a failed check: stop the container, not only its runner
            try:
                stop()
                proc.wait(60)
            except (AssertionError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        cleanup()


def _signal_tini(port: int) -> None:
    """SIGTERM to the image's PID 1 (tini), as a container stop sends it."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{d}/environ").read_bytes()
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"tini") and f"GGMUX_PORT={port}".encode() in env:
            os.kill(int(d), signal.SIGTERM)
            return
    raise AssertionError("no tini process of the container")
