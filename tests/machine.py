"""Which machine a bit-exact pin was recorded on: `fingerprint()` is what must match for
float results to be bit-identical (`tests/algorithms/golden/README.md` measures what differs
across machines of this kind)."""

from __future__ import annotations

import json
import os
import platform

import jax
import jaxlib

# The CPU features that change XLA:CPU's float arithmetic: vector widths (how reductions are
# split) and fused multiply-add (one rounding instead of two).
_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl")


def fingerprint() -> dict:
    """What must match for results to be bit-identical: jax, jaxlib, the CPU, its ISA and its
    core count (Eigen splits a dot's work by threads)."""
    model, flags = "", set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "machine": platform.machine(),
        "cpu": model,
        "cpus": os.cpu_count(),
        "isa": [f for f in _ISA_FLAGS if f in flags],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def same_machine(record_path: str) -> bool:
    """True if the JSON file at `record_path` holds this machine's fingerprint (key
    "fingerprint")."""
    with open(record_path) as f:
        return json.load(f)["fingerprint"] == fingerprint()
