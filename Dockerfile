# ggmux in a container: many GGUF models behind one OpenAI-compatible port.
#
#   docker build -t ggmux .                       # CPU build, as README's CMAKE_ARGS
#   docker run -p 8080:8080 -v /srv/models:/models ggmux
#   docker run -p 8080:8080 -e GGMUX_MODELS_MAX=2 -e GGMUX_API_KEY=... -v /srv/models:/models ggmux
#
# Every `ggmux serve` option is also GGMUX_<OPTION> (the command line wins).
# The demo models: docker build --build-arg EXTRAS=demo -t ggmux-demo . and
# run it with GGMUX_MODELS_DIR= (empty: no models dir, so the demo models serve).
#
# podman: podman build --format docker -t ggmux .  (the OCI format has no
# HEALTHCHECK: podman drops it with a warning).
# NVIDIA GPUs (llama.cpp's CUDA backend, on an nvidia/cuda base of the same
# distribution in both stages; run with --gpus all, podman: --device nvidia.com/gpu=all):
#   docker build --build-arg BASE=nvidia/cuda:12.8.1-devel-ubuntu24.04 \
#     --build-arg RUNTIME_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=on -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined" \
#     -t ggmux-cuda .
# Behind a TLS-intercepting proxy: put its CA certificate (PEM, *.crt) in
# certs/ before the build; pip and the build trust it.
# RUN --mount=type=cache keeps pip's cache between builds (BuildKit, the
# default builder since Docker 23, and podman/buildah), so a rebuild does not
# compile llama-cpp-python again.

ARG BASE=debian:bookworm-slim
ARG RUNTIME_BASE=debian:bookworm-slim

# ---- build: llama-cpp-python compiled once, ggmux as a wheel -------------------
FROM ${BASE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
      build-essential cmake git ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# a TLS-intercepting proxy's CA certificates (certs/*.crt), trusted before
# the first pip; pip reads the system bundle through PIP_CERT
COPY certs/ /tmp/certs/
RUN find /tmp/certs -name '*.crt' -exec cp {} /usr/local/share/ca-certificates/ \; \
 && update-ca-certificates && rm -rf /tmp/certs
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/ggmux && /opt/ggmux/bin/pip install --upgrade pip wheel
# -march=native off: ggml's native build segfaults on CPUs that advertise AMX
# inside a VM (README); these flags suit any x86-64 CPU with AVX2.
ARG CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
ENV CMAKE_ARGS=${CMAKE_ARGS}
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/ggmux/bin/pip wheel --wheel-dir /wheels "llama-cpp-python>=0.3"
COPY . /src
ARG EXTRAS=""
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/ggmux/bin/pip wheel --wheel-dir /wheels --find-links /wheels \
      "/src${EXTRAS:+[$EXTRAS]}"

# ---- runtime: the wheels, a non-root user, a models volume -----------------------
FROM ${RUNTIME_BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv libgomp1 tini \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
ARG EXTRAS=""
RUN python3 -m venv /opt/ggmux \
 && /opt/ggmux/bin/pip install --no-cache-dir --no-index --find-links /wheels \
      "ggmux${EXTRAS:+[$EXTRAS]}" \
 && rm -rf /wheels
RUN useradd --system --uid 10001 --create-home --home-dir /home/ggmux ggmux \
 && mkdir -p /models && chown ggmux:ggmux /models
ENV PATH=/opt/ggmux/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    GGMUX_HOST=0.0.0.0 \
    GGMUX_PORT=8080 \
    GGMUX_MODELS_DIR=/models \
    GGMUX_HF_CACHE=0
USER ggmux
WORKDIR /home/ggmux
VOLUME ["/models"]
EXPOSE 8080
# /health answers 200 while the proxies serve; it never needs a key
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('GGMUX_PORT', '8080'), timeout=4)"]
# SIGTERM drains: requests being answered finish (up to 10 s), waiting ones
# get 503, then every instance stops; give it that long (compose: stop_grace_period)
STOPSIGNAL SIGTERM
# tini as PID 1: forwards SIGTERM to the supervisor and reaps what a `cmd`
# instance leaves behind
ENTRYPOINT ["tini", "--", "ggmux"]
CMD ["serve"]
