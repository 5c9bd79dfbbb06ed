"""Independent NumPy references for the asynchronous algorithms (spec area_async.md 2.2-2.5).

They follow the spec's *eager* form (a client computes x_i = LU_i(read model) when it reads,
and delivers it at its next event), whereas the library computes x_i lazily at delivery. The
event sequence (who fires, staleness, aggregation) is replayed from the event engine with the
keys the algorithms use, so only the algorithms' arithmetic is compared.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms.core import COHORT, round_key

# XLA's LLVM backend at -O0: IEEE arithmetic as at the default level (no fast-math either
# way), but ~40% less compile time, which dominates these short runs. The HLO passes (fusion,
# copy insertion) are unchanged.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.lru_cache(maxsize=32)
def _scan(alg, iterations, collect):
    def go(state, data, key):
        def body(state, _):
            state, metrics = alg.step(state, data, key)
            return state, (metrics, collect(state) if collect else 0)

        return jax.lax.scan(body, state, None, length=iterations)

    return jax.jit(go, compiler_options=FAST_COMPILE)


def run(alg, data, params, iterations, key, collect=None):
    """Jitted scan of `iterations` steps (compiled once per algorithm, length and `collect`:
    tests share a compilation by passing the same objects); returns (final state, metrics,
    collected [T, ...])."""
    state, (metrics, out) = _scan(alg, iterations, collect)(alg.init(params, key), data, key)
    return state, jax.device_get(metrics), jax.device_get(out)


def replay_ticks(events, key, iterations, after=False):
    """The engine's ticks `[T, ...]` as the algorithms draw them (key round_key(key, k, COHORT));
    `after`: the algorithm reads after the aggregation (staleness counts from there)."""
    state = events.init(key)

    def body(state, _):
        tick = events.draw(state, round_key(key, state.k, COHORT))
        return events.advance(state, tick, read_after_aggregate=after), tick

    scan = lambda s: jax.lax.scan(body, s, None, length=iterations)
    _, ticks = jax.jit(scan, compiler_options=FAST_COMPILE)(state)
    return jax.device_get(ticks)


def replay(events, key, iterations, after=False):
    """Per iteration: (sorted active client ids, {id: tau}, aggregate)."""
    ticks = replay_ticks(events, key, iterations, after)
    out = []
    for k in range(iterations):
        act = ticks.active[k]
        ids = ticks.ids[k][act]
        order = np.argsort(ids)
        taus = dict(zip(ids.tolist(), ticks.tau[k][act].tolist(), strict=True))
        out.append((ids[order].tolist(), taus, bool(ticks.aggregate[k])))
    return out


def local_update(problem, i, z, lr, steps):
    """K full-batch GD steps on f_i(w) = 1/2 w'H_i w - c_i'w."""
    h, c = problem.hessians[i], problem.linear[i]
    for _ in range(steps):
        z = z - lr * (h @ z - c)
    return z


def area_reference(problem, x0, seq, *, lr, steps, init_mode="compute", after=False, w=None):
    n = problem.num_clients
    w = np.full(n, 1.0 / n) if w is None else w
    xs, us = np.array(x0, np.float64), np.zeros_like(x0, dtype=np.float64)
    y = np.tile(xs, (n, 1))
    if init_mode == "compute":
        x = np.stack([local_update(problem, i, xs, lr, steps) for i in range(n)])
    else:
        x = y.copy()
    history = []
    for ids, _, agg in seq:
        for i in ids:  # deliveries
            us = us + w[i] * (x[i] - y[i])
            y[i] = x[i]
        read = xs
        if agg:
            xs, us = xs + us, np.zeros_like(us)
        if after:
            read = xs
        for i in ids:  # replies: new work from the read model
            x[i] = local_update(problem, i, read, lr, steps)
        history.append(xs.copy())
    return np.array(history), y


def buffered_reference(problem, x0, seq, *, lr, steps, kind, weight=None, beta=0.5, after=False):
    """AS-FedAvg ("sum"), FedBuff ("mean", staleness weight fn), MIFA ("mifa"), FedAsync ("mix")."""
    n = problem.num_clients
    xs = np.array(x0, np.float64)
    r = np.tile(xs, (n, 1))
    x = np.stack([local_update(problem, i, xs, lr, steps) for i in range(n)])
    buf, cnt = np.zeros_like(xs), 0
    g = np.zeros((n, xs.size))
    weight = weight or (lambda tau: 1.0)
    history = []
    for ids, taus, agg in seq:
        read = xs.copy()
        for i in ids:
            if kind == "mix":
                a = beta * weight(taus[i])
                xs = (1 - a) * xs + a * x[i]
            elif kind == "mifa":
                g[i] = r[i] - x[i]
            else:
                buf = buf + weight(taus[i]) * (x[i] - r[i])
            cnt += 1
        if kind != "mix" and agg:
            if kind == "sum":
                xs = xs + buf
            elif kind == "mean":
                xs = xs + buf / cnt
            else:
                xs = xs - g.mean(0)
            buf, cnt = np.zeros_like(xs), 0
        if agg:
            cnt = 0
        if after:
            read = xs
        for i in ids:
            r[i] = read
            x[i] = local_update(problem, i, read, lr, steps)
        history.append(xs.copy())
    return np.array(history)


def params_w(state_or_params):
    p = getattr(state_or_params, "params", state_or_params)
    return jnp.asarray(p["w"])
