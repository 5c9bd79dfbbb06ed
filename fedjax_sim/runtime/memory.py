"""Memory sizing: how much memory a run may use, read in one place.

The host's available memory is `MemAvailable` in `/proc/meminfo` (None where there is no such
file); an accelerator's comes from its allocator (`device.memory_stats()`). Used by the
up-front checks (`validate`), the sweep planner (`sweep`) and the benchmarks (`bench`).
"""

from __future__ import annotations

from typing import Any

GiB = 2**30
HOST_BUDGET_CAP = 8 * GiB  # the machine is shared: a default budget never exceeds it
FALLBACK_BUDGET = 4 * GiB  # where the available memory cannot be read


def host_available_bytes() -> int | None:
    """`MemAvailable` of `/proc/meminfo` in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _is_accelerator(device: Any) -> bool:
    return device is not None and getattr(device, "platform", "cpu") != "cpu"


def available_bytes(device: Any = None) -> int | None:
    """Free memory for a run: an accelerator's free bytes (its limit less what is in use),
    or the host's `MemAvailable` (`device` None or a CPU device); None if unknown."""
    if _is_accelerator(device):
        try:
            stats = device.memory_stats() or {}
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        except (KeyError, TypeError, RuntimeError):
            return None
    return host_available_bytes()


def default_budget_bytes(device: Any = None) -> int:
    """The default memory budget: half an accelerator's memory limit; on the host (`device`
    None, a CPU device or an accelerator without a limit) half of `MemAvailable`, at most
    8 GiB; 4 GiB where neither can be read."""
    if _is_accelerator(device):
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) // 2
    avail = host_available_bytes()
    return int(min(HOST_BUDGET_CAP, avail / 2)) if avail else FALLBACK_BUDGET
