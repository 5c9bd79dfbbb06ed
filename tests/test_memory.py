"""Memory sizing (`fedjax_sim.runtime.memory`): one reader of the host's memory, one default
budget."""

import pathlib

from fedjax_sim.runtime import memory

GiB = 2**30


class FakeDevice:
    """An accelerator whose allocator reports `stats`."""

    platform = "gpu"

    def __init__(self, **stats: int):
        self.stats = stats

    def memory_stats(self) -> dict[str, int]:
        return self.stats


def test_host_budget_is_half_of_available_capped(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 6 * GiB)
    assert memory.default_budget_bytes() == 3 * GiB
    assert memory.available_bytes() == 6 * GiB
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 64 * GiB)
    assert memory.default_budget_bytes() == 8 * GiB
    monkeypatch.setattr(memory, "host_available_bytes", lambda: None)
    assert memory.default_budget_bytes() == 4 * GiB
    assert memory.available_bytes() is None


def test_accelerator_budget_and_free_bytes(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 6 * GiB)
    gpu = FakeDevice(bytes_limit=80 * GiB, bytes_in_use=30 * GiB)
    assert memory.default_budget_bytes(gpu) == 40 * GiB
    assert memory.available_bytes(gpu) == 50 * GiB
    assert memory.default_budget_bytes(FakeDevice()) == 3 * GiB  # no limit: the host's
    assert memory.available_bytes(FakeDevice()) is None


def test_host_memory_is_read_in_one_place():
    root = pathlib.Path(memory.__file__).parents[1]  # the whole package
    readers = {p.name for p in root.rglob("*.py") if "/proc/meminfo" in p.read_text()}
    assert readers == {"memory.py"}
