"""Measurement primitives: machine info, matmul peak, loop-aware XLA FLOP counts, memory,
and the timing of one compiled round.

FLOPs: `compiled.cost_analysis()["flops"]` counts the body of every `while` loop ONCE (XLA
does not multiply by the trip count; `lax.scan` over local steps and `lax.map` over client
chunks both lower to while loops). `loop_aware_flops` corrects this on the jaxpr: for each
`scan` of length L with body b, `T = X + L T(b) - X(b)` where `X(.)` is XLA's count of the
compiled (sub)program and `T(.)` the true count, applied recursively. Loops with a
data-dependent trip count (`while_loop`) cannot be corrected and are reported in
`flops_method`.

Memory: on GPU/TPU the device allocator's `peak_bytes_in_use`; on CPU the process's peak
resident set (`ru_maxrss`), which is process-wide and never decreases, so isolate each
measurement in its own process when its peak matters (see `fedjax_sim.app.bench.suites`).
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex


# ------------------------------------------------------------------------------ machine
def machine_info() -> dict[str, Any]:
    """Device kind, backend, versions and load: attached to every result row."""
    dev = jax.devices()[0]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "device_kind": dev.device_kind,
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": memory_gib(),
        "load_avg_1m": round(load[0], 2),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`; `platform.processor()` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> float | None:
    """Physical memory in GiB (None where `sysconf` does not say)."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------ peak
def matmul_peak(n: int | None = None, repeats: int = 5) -> dict[str, float]:
    """f32 `[n, n] @ [n, n]` rate on the default device: the roofline's peak. n defaults to
    2048 on CPU (the fastest size measured here) and 8192 on accelerators. Peak = best of
    `repeats` calls (the upper envelope), median reported beside it."""
    if n is None:
        n = 2048 if jax.default_backend() == "cpu" else 8192
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32)
    b = jax.random.normal(kb, (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(a, b))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        times.append(time.perf_counter() - t0)
    flops = 2.0 * n**3
    return {
        "matmul_n": n,
        "peak_flops_per_s": flops / min(times),
        "matmul_flops_per_s_median": flops / statistics.median(times),
    }


# ------------------------------------------------------------------------------ flops
def _cost(compiled: Any) -> dict[str, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, list | tuple):  # older jax: one dict per partition
        ca = ca[0] if ca else {}
    return dict(ca or {})


def xla_flops(compiled: Any) -> float:
    """XLA's FLOP count of a compiled program (loop bodies counted once)."""
    return float(_cost(compiled).get("flops", 0.0))


def _compile_closed(closed: jex.ClosedJaxpr) -> Any:
    fn = jex.jaxpr_as_fun(closed)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.jit(fn).lower(*avals).compile()


def _loops(jaxpr: jex.Jaxpr) -> tuple[list[tuple[jex.ClosedJaxpr, int]], int]:
    """`([(body, length)] of the scans reachable without entering a loop, #while loops)`."""
    scans: list[tuple[jex.ClosedJaxpr, int]] = []
    whiles = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            scans.append((eqn.params["jaxpr"], int(eqn.params["length"])))
        elif name == "while":
            whiles += 1
        else:
            for sub in jex.jaxprs_in_params(eqn.params):
                s, w = _loops(sub)
                scans += s
                whiles += w
    return scans, whiles


def _true_flops(closed: jex.ClosedJaxpr, x: float | None = None) -> tuple[float, int]:
    """`(T(closed), #uncorrected while loops)`; `x` = XLA's count of `closed` if known."""
    if x is None:
        x = xla_flops(_compile_closed(closed))
    scans, whiles = _loops(closed.jaxpr)
    total = x
    for body, length in scans:
        if length == 1:
            continue  # counted once by XLA: already exact
        x_body = xla_flops(_compile_closed(body))
        t_body, w = _true_flops(body, x_body)
        total += length * t_body - x_body
        whiles += w
    return total, whiles


def loop_aware_flops(fn: Callable[..., Any], *args: Any, compiled: Any = None) -> tuple[float, str]:
    """`(flops, method)`: XLA's count of `jit(fn)(*args)` with every `lax.scan` body
    multiplied by its length (see the module docstring). `compiled` (the compiled `fn`)
    saves one compilation. `args` may be `jax.ShapeDtypeStruct`s."""
    closed = jax.make_jaxpr(fn)(*args)
    x = xla_flops(compiled) if compiled is not None else None
    total, whiles = _true_flops(closed, x)
    method = "xla-cost-analysis, scan-corrected"
    if whiles:
        method += f"; {whiles} while loop(s) with unknown trip count counted once"
    return total, method


# ------------------------------------------------------------------------------ memory
def current_rss_bytes() -> int:
    """Current resident set of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set of this process so far (monotone, process-wide)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory() -> tuple[int, str]:
    """`(bytes, source)`: device allocator peak on GPU/TPU, else the process's peak RSS."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device_peak_bytes_in_use"
    return peak_rss_bytes(), "process_peak_rss"


def xla_memory_bytes(compiled: Any) -> int | None:
    """Arguments + outputs + temporaries of a compiled program (XLA's buffer assignment)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


# ------------------------------------------------------------------------------ timing
def time_round(
    step: Callable[..., Any], state: Any, data: Any, key: jax.Array, repeats: int
) -> dict[str, Any]:
    """Compiles `step(state, data, key) -> (state, metrics)` (lower + compile, timed apart
    from execution), runs it once (first-call), then `repeats` more rounds threading the
    state. Returns times, the compiled program and the last metrics."""
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(state, data, key).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, data, key))
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = jax.block_until_ready(compiled(state, data, key))
        times.append(time.perf_counter() - t0)
    return {
        "compile_s": compile_s,
        "first_round_s": first_s,
        "times": times,
        "compiled": compiled,
        "metrics": metrics,
    }


def time_calls(fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Times a host-driven round (baselines): first call (includes compilation or warm-up),
    then `repeats` calls."""
    t0 = time.perf_counter()
    fn()
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"first_round_s": first_s, "times": times}
