"""The memory ledger: devices, what each replica holds, and what a load needs.

Devices are the host (``/proc/meminfo``) and every NVIDIA GPU that NVML
(nvidia-ml-py) reports, so a CPU-only machine is protected too. Keys are
``"host"``, ``"gpu0"``, ``"gpu1"``, ...; amounts are bytes.

Calibration (DESIGN.md "Memory ledger"): after every report (a replica ready,
measured or gone) the ledger re-reads each device's free memory and sets
``external = total - free - self - tracked``, where ``tracked`` is what our
replicas hold and ``self`` what the supervisor and proxies use. Then
``available = total - external - held`` and a load of a model whose measured
``min`` is ``need`` is short by ``deficit = need - (available - margin)``.
A positive deficit is made up by evicting least recently used idle replicas
one by one; with nothing else loaded the load proceeds anyway, with a
warning (llama.cpp's router has no ledger and simply fails such loads).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MiB = 1 << 20

Amounts = dict[str, int]  # device key -> bytes


@dataclass(slots=True)
class Device:
    """One memory device (bytes; ``calibrated_ns`` is monotonic)."""

    key: str
    kind: int  # 0 host, 1 gpu
    index: int
    total: int
    free: int = 0
    external: int = 0
    held: int = 0
    calibrated_ns: int = 0


def read_meminfo() -> tuple[int, int]:
    """``(MemTotal, MemAvailable)`` of the host in bytes."""
    total = avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    return total, avail


def rss_of(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Nvml:
    """Free/total of NVIDIA GPUs through nvidia-ml-py; empty without NVML."""

    def __init__(self) -> None:
        self.handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.pynvml = pynvml
            self.handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
        except Exception as e:  # noqa: BLE001 - no driver, no library, no GPU
            log.debug("NVML unavailable: %s", e)

    def info(self, i: int) -> tuple[int, int]:
        m = self.pynvml.nvmlDeviceGetMemoryInfo(self.handles[i])
        return int(m.total), int(m.free)


@dataclass(slots=True)
class Ledger:
    """Devices and the margin; ``host_total`` replaces the host's real
    memory with a fixed size and no external use (tests, containers whose
    cgroup limit /proc/meminfo does not show)."""

    margin: int = 0
    host_total: int | None = None
    devices: list[Device] = field(default_factory=list)
    _nvml: _Nvml | None = None

    def __post_init__(self) -> None:
        if self.host_total is not None:
            self.devices.append(Device("host", 0, 0, self.host_total, self.host_total))
        else:
            total, avail = read_meminfo()
            self.devices.append(Device("host", 0, 0, total, avail))
        self._nvml = _Nvml()
        for i in range(len(self._nvml.handles)):
            total, free = self._nvml.info(i)
            self.devices.append(Device(f"gpu{i}", 1, i, total, free))

    def keys(self) -> list[str]:
        return [d.key for d in self.devices]

    def calibrate(self, tracked: Amounts, self_bytes: int = 0) -> None:
        """Re-read free memory; set ``held`` and ``external`` per device."""
        now = time.monotonic_ns()
        for d in self.devices:
            held = tracked.get(d.key, 0)
            d.held = held
            if d.key == "host":
                if self.host_total is not None:
                    d.free = max(0, d.total - held)
                    d.external = 0
                    d.calibrated_ns = now
                    continue
                d.total, d.free = read_meminfo()
                own = self_bytes
            else:
                d.total, d.free = self._nvml.info(d.index)
                own = 0
            d.external = max(0, d.total - d.free - own - held)
            d.calibrated_ns = now

    def headroom(self, held: Amounts) -> Amounts:
        """``available - margin`` per device for the given holdings."""
        return {
            d.key: d.total - d.external - held.get(d.key, 0) - self.margin for d in self.devices
        }

    @staticmethod
    def deficit(need: Amounts, headroom: Amounts) -> Amounts:
        """Bytes short per device (only positive entries)."""
        out = {}
        for k, v in need.items():
            short = v - headroom.get(k, 0)
            if short > 0:
                out[k] = short
        return out


def add(a: Amounts, b: Amounts, sign: int = 1) -> Amounts:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + sign * v
    return out


def fmt(a: Amounts) -> str:
    return ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in sorted(a.items())) or "nothing"
