"""`ClientMap("auto")` measures: the first time a per-client function of a given structure
and cohort size is mapped on a backend, it times candidate modes (`map` with chunks of 1, 4
and 16 clients and `vmap`) and caches the fastest on disk.

The cache key hashes the structure of the per-client function's jaxpr (its primitives,
their static parameters and every shape and dtype; literal values such as a float learning
rate are left out, so the points of a hyper-parameter grid share one measurement), the mapped
arguments' shapes, the cohort size, whether the map sums (`map_sum`), the backend, the
device kind and the jax version. The cache is a JSON file
`$FEDJAX_SIM_CACHE_DIR/client_map.json` (default `~/.cache/fedjax_sim`), so the choice is
measured once per machine kind and then fixed. Different chunk sizes give the same
per-client values up to the last bits (vectorised kernels of another width), so a measured
choice can change results in the last bits compared with another choice: `simulate` records
the mode used (`History.meta["client_map"]`), and passing it explicitly reproduces a run bit
for bit on another machine. The test suite turns measuring off (`FEDJAX_SIM_AUTOTUNE=0`, the
static rule of `ClientMap.resolve`); so does `jax.disable_jit()` (nothing can be compiled).

Measuring runs the mapped function on stand-in inputs of the right shapes (ones for floats,
zeros for integers, fixed keys) under `jax.ensure_compile_time_eval`, while the surrounding
round is being traced: every candidate is compiled once and timed (best of `repeats` runs
after a warm-up run; the two fastest get `repeats` more). Compiling dominates: on 2 loaded
CPU cores the default digits round took about 5 s per candidate, hence three candidates for
a cohort of 10 (chunks of 2 and 8 were never the fastest in `benchmarks/README.md`). Nothing
is printed; a driver may pass a callback to `reporting` (the CLI prints one line per
measurement).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

CANDIDATES: tuple[int | None, ...] = (1, 4, 16, None)  # None: vmap
CACHE_FILE = "client_map.json"
_MEMORY: dict[str, tuple[str, int | None]] = {}


class Choice(NamedTuple):
    """A resolution of `ClientMap("auto")`: the cache key, the mode and chunk chosen, the
    cohort size, and the seconds spent measuring now (None: read from a cache)."""

    key: str
    mode: str
    batch_size: int | None
    num: int
    measured_seconds: float | None


_REPORT: contextvars.ContextVar[Callable[[Choice], None] | None] = contextvars.ContextVar(
    "fedjax_sim_autotune_report", default=None
)


@contextlib.contextmanager
def reporting(callback: Callable[[Choice], None]) -> Iterator[None]:
    """Calls `callback(choice)` for every `ClientMap("auto")` resolved inside (while a round
    is traced)."""
    token = _REPORT.set(callback)
    try:
        yield
    finally:
        _REPORT.reset(token)


def enabled() -> bool:
    """Measuring is on unless `FEDJAX_SIM_AUTOTUNE=0` or inside `jax.disable_jit()`."""
    if jax.config.jax_disable_jit:
        return False
    return os.environ.get("FEDJAX_SIM_AUTOTUNE", "1") not in ("0", "false", "False", "")


def cache_path() -> str:
    """The JSON file of measured choices."""
    root = os.environ.get("FEDJAX_SIM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "fedjax_sim"
    )
    return os.path.join(root, CACHE_FILE)


def _device_kind() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}:{jax.device_count()}"


def _structure(jaxpr: Any) -> str:
    """The jaxpr's primitives, static parameters, shapes and dtypes, without literal values
    (a hyper-parameter closed over as a Python number is a literal) or object addresses."""

    def param(v: Any) -> str:
        if isinstance(v, jex_core.ClosedJaxpr):
            return f"{{{_structure(v.jaxpr)}}}"
        if isinstance(v, jex_core.Jaxpr):
            return f"{{{_structure(v)}}}"
        if isinstance(v, (tuple, list)):
            return "(" + ",".join(param(x) for x in v) + ")"
        text = repr(v)
        return type(v).__name__ if isinstance(v, float) or " at 0x" in text else text

    def atom(v: Any) -> str:
        kind = "lit" if isinstance(v, jex_core.Literal) else "var"
        return f"{kind}:{v.aval.str_short()}"

    lines = [" ".join(atom(v) for v in (*jaxpr.constvars, *jaxpr.invars))]
    for eqn in jaxpr.eqns:
        ins = ",".join(atom(v) for v in eqn.invars)
        outs = ",".join(v.aval.str_short() for v in eqn.outvars)
        params = ",".join(f"{k}={param(v)}" for k, v in sorted(eqn.params.items()))
        lines.append(f"{eqn.primitive.name}[{params}]({ins})->{outs}")
    lines.append(" ".join(atom(v) for v in jaxpr.outvars))
    return ";".join(lines)


def cache_key(fn: Callable[..., Any], xs: tuple, reduce: bool) -> tuple[str, Any, Any]:
    """`(key, closed jaxpr, output tree)` of mapping `fn` over the leading axis of `xs`."""
    per_client = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*per_client)
    num = int(jax.tree.leaves(xs)[0].shape[0])
    text = "|".join(
        [
            jax.__version__,
            jax.default_backend(),
            _device_kind(),
            f"num={num}",
            f"reduce={reduce}",
            str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), xs)),
            _structure(closed.jaxpr),
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24], closed, jax.tree.structure(out_shape)


def _stand_in(aval: Any) -> jax.Array:
    shape, dtype = tuple(aval.shape), aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(
            jnp.zeros((*shape, 2), jnp.uint32), impl=jax.random.key_impl(jax.random.key(0))
        )
    if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.ones(shape, dtype)
    return jnp.zeros(shape, dtype)


def _load() -> dict[str, Any]:
    try:
        with open(cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _store(key: str, entry: dict[str, Any]) -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        table = _load()
        table[key] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a read-only home: keep the in-memory choice
        pass


def measure(
    fn: Callable[..., Any],
    xs: tuple,
    reduce: bool,
    closed: Any,
    out_tree: Any,
    client_map: Callable[[str, int | None], Any],
    *,
    candidates: tuple[int | None, ...] = CANDIDATES,
    repeats: int = 1,
) -> dict[str, float]:
    """Seconds per call of each candidate (`"vmap"` or the chunk size as a string), each
    mapped by `client_map(mode, chunk)` (a `ClientMap`)."""
    num = int(jax.tree.leaves(xs)[0].shape[0])
    chunks = sorted({c for c in candidates if c is not None and c < num})
    modes: list[tuple[str, int | None]] = [("map", c) for c in chunks] + [("vmap", None)]

    def make(mode: str, bs: int | None):
        cmap = client_map(mode, bs)

        def run(consts, inputs):
            def f(*x):
                flat = jax.core.eval_jaxpr(closed.jaxpr, consts, *jax.tree.leaves(x))
                return jax.tree.unflatten(out_tree, flat)

            return (cmap.map_sum if reduce else cmap.map)(f, *inputs)

        return jax.jit(run)

    times: dict[str, float] = {}
    with jax.ensure_compile_time_eval():  # run now, although a round is being traced
        consts = [
            _stand_in(jax.typeof(c)) if isinstance(c, jax.core.Tracer) else c for c in closed.consts
        ]
        inputs = jax.tree.map(_stand_in, xs)
        compiled = {}
        for mode, bs in modes:
            label = "vmap" if mode == "vmap" else str(bs)
            exe = make(mode, bs).lower(consts, inputs).compile()
            compiled[label] = exe
            jax.block_until_ready(exe(consts, inputs))  # warm-up
            times[label] = _best(exe, consts, inputs, repeats)
        for label in sorted(times, key=times.get)[:2]:  # confirm the two fastest
            times[label] = min(times[label], _best(compiled[label], consts, inputs, repeats))
    return times


MIN_SECONDS = 0.2  # each candidate is run at least `repeats` times and this long


def _best(exe: Any, consts: Any, inputs: Any, repeats: int) -> float:
    """Fastest of at least `repeats` runs, repeated until `MIN_SECONDS` (at most 50)."""
    best, total, runs = float("inf"), 0.0, 0
    while runs < max(1, repeats) or (total < MIN_SECONDS and runs < 50):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(consts, inputs))
        dt = time.perf_counter() - t0
        best, total, runs = min(best, dt), total + dt, runs + 1
    return best


def choose(
    fn: Callable[..., Any], xs: tuple, reduce: bool, client_map: Callable[[str, int | None], Any]
) -> tuple[str, int | None]:
    """The cached or measured `(mode, chunk)` for mapping `fn` over `xs`; candidates are
    mapped by `client_map(mode, chunk)` (`ClientMap`, passed in: this module sits below it)."""
    key, closed, out_tree = cache_key(fn, xs, reduce)
    num = int(jax.tree.leaves(xs)[0].shape[0])
    measured = None
    if key not in _MEMORY:
        entry = _load().get(key)
        if entry is None:
            t0 = time.perf_counter()
            times = measure(fn, xs, reduce, closed, out_tree, client_map)
            measured = time.perf_counter() - t0
            best = min(times, key=times.get)
            entry = {
                "mode": "vmap" if best == "vmap" else "map",
                "batch_size": None if best == "vmap" else int(best),
                "seconds": {k: float(np.round(v, 6)) for k, v in times.items()},
                "num": num,
                "device": _device_kind(),
                "jax": jax.__version__,
            }
            _store(key, entry)
        _MEMORY[key] = (entry["mode"], entry["batch_size"])
    choice = _MEMORY[key]
    report = _REPORT.get()
    if report is not None:
        report(Choice(key, *choice, num, measured))
    return choice


__all__ = [
    "CANDIDATES",
    "Choice",
    "cache_key",
    "cache_path",
    "choose",
    "enabled",
    "measure",
    "reporting",
]
