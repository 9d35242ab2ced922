"""pytest plugin for llama.cpp's server tests in ggmux's conformance run
(``bench/conformance.py`` loads it with ``-p ggmux_conformance``).

It patches the suite's harness (``tools/server/tests/utils.py``), never a
server's requests or answers beyond what is said here:

* ``ServerPreset.load_all`` (the session fixture that downloads every
  model once) does nothing: the run's fake Hugging Face cache holds them;
* with ``GGMUX_CONFORMANCE_ADD_MODEL=1`` (the runner's default), a POST
  body that names no ``model`` (or ``null``) gets the served model's name, on a server
  started with one model: llama-server then serves it as before (one model:
  the name is not checked), and a router (ggmux) can route it. The name is
  the one the shim gives the model: the first ``--alias``, else the repo,
  else the file's name.

This file runs in the suite's own virtualenv: standard library only.
"""

from __future__ import annotations

import os
import sys


def _served_name(server) -> str | None:
    if getattr(server, "model_alias", None):
        return str(server.model_alias).split(",")[0].strip()
    if getattr(server, "model_hf_repo", None):
        return str(server.model_hf_repo)
    if getattr(server, "model_file", None):
        return os.path.basename(str(server.model_file)).removesuffix(".gguf")
    return None  # a router: the tests name their models


def _with_model(server, data):
    if isinstance(data, dict) and data.get("model") is None:
        name = _served_name(server)
        if name is not None:
            return {**data, "model": name}
    return data


def pytest_configure(config) -> None:
    sys.path.insert(0, os.getcwd())  # the suite's tests folder: utils.py
    import utils

    utils.ServerPreset.load_all = staticmethod(lambda: None)
    if os.environ.get("GGMUX_CONFORMANCE_ADD_MODEL", "1") != "1":
        return
    cls = utils.ServerProcess
    make_request, make_stream_request = cls.make_request, cls.make_stream_request

    def request(self, method, path, data=None, *args, **kwargs):
        if method == "POST":
            data = _with_model(self, data)
        return make_request(self, method, path, data, *args, **kwargs)

    def stream_request(self, method, path, data=None, *args, **kwargs):
        if method == "POST":
            data = _with_model(self, data)
        return make_stream_request(self, method, path, data, *args, **kwargs)

    cls.make_request, cls.make_stream_request = request, stream_request
