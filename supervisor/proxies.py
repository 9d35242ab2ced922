"""The supervisor's proxy processes: each started with its keys through a
pipe (:meth:`ProxyChildren._spawn_proxy`; its rows of the shared segment
zeroed first), counted ready when it prints ``ready``, waited for at start
(:meth:`ProxyChildren.wait_proxies_ready`), and reaped and restarted when
it exits (one that exits before it ever listened stops the server: a
configuration problem, not a crash). A mixin of
:class:`~ggmux.supervisor.main.Supervisor`; its attributes are the
supervisor's.
"""

from __future__ import annotations

import logging
import os
import time

from ..http1.auth import keys_pipe
from ..shm.keytable import key_table_name
from .children import Child

log = logging.getLogger("ggmux.supervisor")


class ProxyChildren:
    """The proxies' half of :class:`~ggmux.supervisor.main.Supervisor`
    (module docstring)."""

    def _spawn_proxy(self, idx: int) -> None:
        st = self.state
        seg = st.seg
        seg.counters[idx] = 0  # a dead proxy's rows are zeroed before its replacement starts
        seg.waiters[idx] = 0
        seg.prefix[idx] = 0  # its part of the prefix index too (issue 20)
        seg.prefix_forget[idx] = 0
        seg.prefix_forget_disk[idx] = 0
        if self.keys is not None and self.keys.table is not None:
            self.keys.table.proxy_gone(idx)  # its requests in flight no longer hold their keys
        cfg = self.cfg
        argv = [
            st.python, "-m", "ggmux.proxy", "--index", str(idx), "--shm", cfg.shm_name,
            "--mq", cfg.mq_name, "--host", cfg.host, "--port", str(cfg.port),
            "--load-wait", str(cfg.load_wait), *cfg.proxy_args,
            *(("--key-table", key_table_name(cfg.shm_name)) if self.keys is not None else ()),
            *(("--keyed",) if cfg.keys_file else ()),
        ]
        # the keys through a pipe: no key on a command line or in an
        # environment (issue 11); stdout says "ready"; stderr lines are
        # logged (and kept in the log ring) here
        fd = keys_pipe(cfg.proxy_keys)
        try:
            child = self.children.start([*argv, "--keys-fd", str(fd)], f"proxy-{idx}",
                                        on_line=self._on_proxy_line, pass_fds=(fd,))
        finally:
            os.close(fd)
        st.proxies[idx] = child
        log.debug("started proxy %d (pid %d)", idx, child.pid)

    def _on_proxy_line(self, child: Child, line: bytes) -> None:
        if line.strip() == b"ready":
            idx = int(child.tag.split("-", 1)[1])
            self.proxy_ready.add(idx)

    def wait_proxies_ready(self, timeout: float = 30.0) -> bool:
        """Block (polling) until every proxy listens; False on timeout, on a
        proxy that exited before listening (``startup_failed``) and on a
        stop asked meanwhile (``state.stopping_all`` without
        ``startup_failed``: :meth:`run` exits 0, issue 31 item 10)."""
        deadline = time.monotonic() + timeout
        while len(self.proxy_ready) < self.cfg.proxies and time.monotonic() < deadline:
            self._poll_once(50)
            self.step()
            if self.state.stopping_all:
                return False
        return len(self.proxy_ready) >= self.cfg.proxies

    def _reap_proxies(self) -> None:
        st = self.state
        for idx, child in list(st.proxies.items()):
            code = self.children.reap(child)
            if code is None:
                continue
            del st.proxies[idx]
            self.proxy_ready.discard(idx)
            if not st.stopping_all:
                if idx not in self.proxy_ready and not self._serving:
                    # it never listened: a configuration problem, not a crash
                    log.error("proxy %d exited with code %s before listening", idx, code)
                    st.stopping_all = True
                    self.startup_failed = True
                    continue
                log.error("proxy %d exited with code %s: restarting", idx, code)
                self._spawn_proxy(idx)
