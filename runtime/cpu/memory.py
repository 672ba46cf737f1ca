"""How much host memory a new program may take: the kernel's MemAvailable, or what the cgroup
(a container's memory limit) has left when that is lower."""
from __future__ import annotations

import os


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_left():
    """Bytes the cgroup may still take (limit - usage), or None without a limit."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, use = _read(limit), _read(usage)
        if lim and use and lim.isdigit() and use.isdigit() and int(lim) < 1 << 60:
            return max(0, int(lim) - int(use))
    return None


def available() -> tuple[int, str] | None:
    """(bytes, where the figure comes from), or None where the system does not say."""
    meminfo = _read("/proc/meminfo") or ""
    found = None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            found = (int(line.split()[1]) * 1024, "MemAvailable")
    left = _cgroup_left()
    if left is not None and (found is None or left < found[0]):
        found = (left, "the cgroup's memory limit less its usage")
    if found is None and hasattr(os, "sysconf"):
        try:
            found = (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages")
        except (ValueError, OSError):
            pass
    return found
