"""Arrival models: who fires in an event iteration (synchronous cohorts: `cohorts`).

Asynchronous event engine (`Events`), shared by every asynchronous algorithm (AREA, AS-FedAvg,
FedBuff, MIFA, FedAsync; spec `docs/specs/area_async.md`, Section 3). One *iteration* is
one pure transition; a run is a `lax.scan` over iterations:

    events = Events(Arrivals.poisson(rates), Aggregation.every(4))
    es = events.init(key)                       # EventState (per-client bookkeeping [C])
    tick = events.draw(es, key_k)               # who fires now, aggregate or not, new time
    ...  deliveries / replies of the algorithm on the compacted slots tick.ids [B]  ...
    es = events.advance(es, tick)               # bookkeeping after the iteration

Arrival models (`Arrivals`):
- "bernoulli" (default): client i fires in an iteration with probability p_i, independently
  of the other clients and of the past. Implemented by its exact equivalent in law: each
  client holds the iteration of its next arrival, and after each arrival draws a
  Geometric(p_i) gap with its own key. Finding the due clients is a compare over `[C]`, no
  `[C]` random draw per iteration. Poisson clocks are discretised as p_i = 1 - exp(-lambda_i dt)
  (`Arrivals.poisson`); every iteration is worth `dt` time.
- "categorical" (paper-exact, Sections 3.1/3.2 of the spec): exactly one event per iteration,
  J ~ Categorical(lambda_1..lambda_n[, lambda_s]) by inverse CDF (O(log C)); the time
  advances by Exp(Lambda), Lambda = sum of the rates in the draw. This is the embedded jump
  chain of independent Poisson clocks, so it reproduces the paper's continuous-time model.
- "forced": the fire masks of a `[T, C]` bool array (`Arrivals.forced`; iteration t fires
  exactly row t mod T), for controlled experiments.
- per-client rates as an array, or drawn from a clipped normal (`normal_rates`).
- availability (`Availability`): a client can only fire while available (a `[C, T]` trace or
  a periodic on/off window, both functions of the simulated time). Arrivals of unavailable
  clients are dropped (Poisson thinning: exact for the continuous-time model), counted as
  `lost`.

Concurrency cap (`Events(concurrency=K)`, bernoulli mode): at most K clients train at once;
finishing clients go idle and idle ones start in their place, reading x_s when they start
(`Tick.starts`; the class docstring). Without it (default) every client trains all the time
and a delivering client restarts at once.

Server aggregation rules (`Aggregation`): every Delta deliveries ("count"; in bernoulli mode
several deliveries can arrive at once and all buffered ones are applied), a random server event
("random": Bernoulli(p_s) per iteration, or the server clock lambda_s inside the categorical
draw), or a fixed time interval ("time": when the simulated time crosses a multiple of it).

Cost follows firing clients, not C: the due clients are compacted into `capacity` slots
(`compact`, the same indices as `jnp.nonzero(mask, size=capacity, fill_value=C)` computed by a
blocked prefix sum); algorithms train and update only those slots (`core.rows.gather_rows` /
`scatter_rows`, in place; padding slots hold id C and are dropped). Due clients that
do not fit are deferred: they stay due and are served first in the next iteration (`overflow`
counts them). `capacity=None` uses all C slots (the "compute every client and mask" reference).

Deviation, documented: with the bernoulli mode and a `[C, T]` availability trace, availability
is checked when a due client is served (a deferred client may find itself unavailable).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from fedjax_sim.core.rows import gather_rows, scatter_rows

# ------------------------------------------------------------------------------ compaction
_BLOCK = 32
_MAX_GAP = 2**30
NEVER = 2**31 - 1  # `next_event` of an idle client under a concurrency cap


def prefix_count(mask: jax.Array) -> jax.Array:
    """Inclusive prefix sum of a `[C]` bool mask as `[C]` float32 (exact for C < 2^24).

    A blocked triangular matmul, recursing on the block totals: XLA's CPU cumsum (and so
    `jnp.nonzero`) is ~10x slower at C = 1e5."""
    return _prefix_sum(mask.astype(jnp.float32))


def _prefix_sum(x: jax.Array) -> jax.Array:
    n = x.shape[0]
    block = min(n, _BLOCK)
    nb = -(-n // block)
    blocks = jnp.pad(x, (0, nb * block - n)).reshape(nb, block)
    tri = jnp.triu(jnp.ones((block, block), jnp.float32))
    inner = jnp.dot(blocks, tri, precision=lax.Precision.HIGHEST)  # [nb, block]
    if nb == 1:
        return inner.reshape(-1)[:n]
    totals = inner[:, -1]
    return (inner + (_prefix_sum(totals) - totals)[:, None]).reshape(-1)[:n]


def compact(mask: jax.Array, capacity: int) -> jax.Array:
    """Ids of the first `capacity` true entries of `mask [C]`, padded with C: `[capacity]`
    int32. Equal to `jnp.nonzero(mask, size=capacity, fill_value=C)[0]`."""
    n = mask.shape[0]
    if n >= 2**24:
        return jnp.nonzero(mask, size=capacity, fill_value=n)[0].astype(jnp.int32)
    counts = prefix_count(mask)
    targets = jnp.arange(1, capacity + 1, dtype=jnp.float32)
    ids = jnp.searchsorted(counts, targets, side="left", method="scan_unrolled")
    return jnp.where(targets <= counts[-1], ids, n).astype(jnp.int32)


def compact_first(first: jax.Array, second: jax.Array, capacity: int) -> jax.Array:
    """Compaction with priority: ids of the first `capacity` true entries of `first [C]`,
    then of `second [C]`, each in id order: `[capacity]` int32 (padded with C)."""
    n_first = jnp.sum(first)
    a, z = compact(first, capacity), compact(second, capacity)
    pos = jnp.arange(capacity)
    return jnp.where(pos < n_first, a, z[jnp.clip(pos - n_first, 0, capacity - 1)])


# ------------------------------------------------------------------------------ configuration
def _as_rates(values: Any, name: str, num_clients: int | None = None) -> np.ndarray:
    arr = np.asarray(values, np.float64)
    if arr.ndim == 0:
        if num_clients is None:
            raise ValueError(f"a scalar {name} needs num_clients")
        arr = np.full(num_clients, float(arr))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a scalar or a non-empty [C] array, got shape {arr.shape}")
    if num_clients is not None and arr.size != num_clients:
        raise ValueError(f"{name} has {arr.size} entries but num_clients={num_clients}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} has non-finite entries")
    return arr


def normal_rates(
    num_clients: int, mean: float = 10.0, sd: float = 3.0, *, minimum: float = 0.1, seed: int = 0
) -> np.ndarray:
    """Per-client rates lambda_i ~ N(mean, sd^2) clipped below at `minimum`, `[C]` float64.

    The paper's N(10, 5) / N(10, 3) read as (mean, standard deviation) and clipped at 0.1
    (spec 7.3: negative draws occur)."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if sd < 0:
        raise ValueError(f"rate standard deviation must be >= 0, got {sd}")
    if not minimum > 0:
        raise ValueError(f"minimum rate must be > 0, got {minimum}")
    return np.maximum(np.random.default_rng(seed).normal(mean, sd, num_clients), minimum)


@dataclasses.dataclass(frozen=True, eq=False)
class Arrivals:
    """When clients fire. Build with `bernoulli`, `poisson`, `categorical` or `forced`.

    Attributes:
      mode: "bernoulli" (independent per-client draws each iteration), "categorical"
        (exactly one event per iteration among the clients [and the server]) or "forced"
        (the fire masks of a `[T, C]` array).
      values: `[C]` float64: firing probabilities p_i (bernoulli; forced: the frequencies
        of the mask) or rates lambda_i (categorical, any positive scale; P(J = i) =
        lambda_i / Lambda).
      dt: simulated time per iteration (bernoulli, forced).
      mask: `[T, C]` bool (forced): who fires in iteration t (row t mod T).
    """

    mode: Literal["bernoulli", "categorical", "forced"]
    values: np.ndarray
    dt: float = 1.0
    mask: np.ndarray | None = None

    def __post_init__(self):
        if self.mode not in ("bernoulli", "categorical", "forced"):
            raise ValueError(
                f"arrival mode must be bernoulli|categorical|forced, got {self.mode!r}"
            )
        if self.mode == "bernoulli" and not np.all((self.values > 0) & (self.values <= 1)):
            bad = self.values[~((self.values > 0) & (self.values <= 1))][0]
            raise ValueError(f"firing probabilities p_i must be in (0, 1], got {bad}")
        if self.mode == "categorical" and not np.all(self.values > 0):
            raise ValueError(f"client rates must be > 0, got {self.values.min()}")
        if not self.dt > 0:
            raise ValueError(f"dt must be > 0, got {self.dt}")

    @classmethod
    def bernoulli(cls, p: Any, *, num_clients: int | None = None, dt: float = 1.0) -> Arrivals:
        """Client i fires in each iteration with probability `p[i]` (scalar: same for all)."""
        return cls("bernoulli", _as_rates(p, "firing probabilities", num_clients), dt)

    @classmethod
    def poisson(
        cls,
        rates: Any,
        *,
        num_clients: int | None = None,
        dt: float | None = None,
        max_probability: float = 0.1,
    ) -> Arrivals:
        """Poisson clocks lambda_i discretised with step dt: p_i = 1 - exp(-lambda_i dt).

        `dt=None` picks the largest dt with max_i p_i <= `max_probability` (spec 3.3)."""
        lam = _as_rates(rates, "rates", num_clients)
        if not np.all(lam > 0):
            raise ValueError(f"rates must be > 0, got {lam.min()}")
        if dt is None:
            if not 0 < max_probability < 1:
                raise ValueError(f"max_probability must be in (0, 1), got {max_probability}")
            dt = float(-np.log1p(-max_probability) / lam.max())
        p = -np.expm1(-lam * dt)
        return cls("bernoulli", p, float(dt))

    @classmethod
    def categorical(cls, rates: Any, *, num_clients: int | None = None) -> Arrivals:
        """One event per iteration, J ~ Categorical(rates) (plus the server clock for the
        random aggregation rule); time advances by Exp(sum of rates)."""
        return cls("categorical", _as_rates(rates, "rates", num_clients))

    @classmethod
    def forced(cls, mask: Any, *, dt: float = 1.0) -> Arrivals:
        """Exactly the clients of `mask[t mod T]` (`[T, C]` bool) fire in iteration t = 0,
        1, ... (for controlled experiments and tests; at most the largest row fits the
        default capacity, a smaller capacity drops the rest and counts them as overflow)."""
        m = np.asarray(mask)
        if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0 or m.dtype != np.bool_:
            raise ValueError(f"forced fire masks must be a [T, C] bool array, got {m.shape}")
        return cls("forced", m.mean(0), dt, m)

    @property
    def num_clients(self) -> int:
        return int(self.values.size)


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """When the server aggregates (spec 2.1, Remark 2 of the paper).

    Attributes:
      rule: "count" (every `delta` deliveries), "random" (a server event: Bernoulli(`p`) per
        iteration in bernoulli mode, the server clock of rate `p` inside the categorical
        draw), or "time" (whenever the simulated time crosses a multiple of `interval`).
    """

    rule: Literal["count", "random", "time"] = "count"
    delta: int = 4
    p: float = 0.0
    interval: float = 0.0

    def __post_init__(self):
        if self.rule not in ("count", "random", "time"):
            raise ValueError(f"aggregation rule must be count|random|time, got {self.rule!r}")
        if self.rule == "count" and (int(self.delta) != self.delta or self.delta < 1):
            raise ValueError(
                f"Delta (deliveries per aggregation) must be an integer >= 1, got {self.delta}"
            )
        if self.rule == "random" and not self.p > 0:
            raise ValueError(f"the server event probability/rate must be > 0, got {self.p}")
        if self.rule == "time" and not self.interval > 0:
            raise ValueError(f"the aggregation interval must be > 0, got {self.interval}")

    @classmethod
    def every(cls, delta: int) -> Aggregation:
        return cls("count", delta=delta)

    @classmethod
    def random(cls, p: float) -> Aggregation:
        return cls("random", p=p)

    @classmethod
    def timer(cls, interval: float) -> Aggregation:
        return cls("time", interval=interval)


@dataclasses.dataclass(frozen=True, eq=False)
class Availability:
    """When each client can fire, as a function of the simulated time t.

    Build with `from_trace(mask [C, T], slot)` (column `floor(t / slot)`; past the end the
    trace wraps around if `wrap`, else the last column holds forever) or with
    `periodic(period, on_fraction, phase)` (client i is available while
    `(t + phase_i) mod period < on_fraction * period`).
    """

    trace: np.ndarray | None = None  # [C, T] bool
    slot: float = 1.0
    wrap: bool = False
    period: np.ndarray | None = None  # [C]
    on_fraction: np.ndarray | None = None  # [C]
    phase: np.ndarray | None = None  # [C]

    @classmethod
    def from_trace(cls, trace: Any, *, slot: float = 1.0, wrap: bool = False) -> Availability:
        tr = np.asarray(trace)
        if tr.ndim != 2 or tr.shape[1] == 0:
            raise ValueError(f"availability trace must have shape [C, T], got {tr.shape}")
        if tr.dtype != np.bool_:
            raise ValueError(f"availability trace must be boolean, got dtype {tr.dtype}")
        if not slot > 0:
            raise ValueError(f"availability slot must be > 0, got {slot}")
        return cls(trace=tr, slot=float(slot), wrap=wrap)

    @classmethod
    def periodic(
        cls, period: Any, on_fraction: Any, phase: Any = 0.0, *, num_clients: int
    ) -> Availability:
        per = _as_rates(period, "availability period", num_clients)
        on = _as_rates(on_fraction, "availability on_fraction", num_clients)
        ph = _as_rates(phase, "availability phase", num_clients)
        if not np.all(per > 0):
            raise ValueError(f"availability period must be > 0, got {per.min()}")
        if not np.all((on > 0) & (on <= 1)):
            raise ValueError("availability on_fraction must be in (0, 1]")
        return cls(period=per, on_fraction=on, phase=ph)

    @property
    def num_clients(self) -> int:
        return int(self.trace.shape[0] if self.trace is not None else self.period.size)

    def at(self, t: jax.Array, ids: jax.Array) -> jax.Array:
        """`[B]` bool: are clients `ids [B]` (C = padding, reported unavailable) available at
        time `t`?"""
        c = self.num_clients
        safe = jnp.minimum(ids, c - 1)
        if self.trace is not None:
            num_slots = self.trace.shape[1]
            col = jnp.floor(t / self.slot).astype(jnp.int32)
            col = col % num_slots if self.wrap else jnp.clip(col, 0, num_slots - 1)
            ok = jnp.asarray(self.trace)[safe, col]
        else:
            per = jnp.asarray(self.period)[safe]
            pos = jnp.mod(t + jnp.asarray(self.phase)[safe], per)
            ok = pos < jnp.asarray(self.on_fraction)[safe] * per
        return ok & (ids < c)


# ------------------------------------------------------------------------------ state
@struct.dataclass
class EventState:
    """Bookkeeping of the event engine (all clients stacked on axis 0).

    Attributes:
      k: `[]` int32, iterations done (the next iteration has index k + 1).
      t: `[]` float, simulated wall-clock time.
      version: `[]` int32, aggregations so far (server model version).
      count: `[]` int32, deliveries since the last aggregation.
      read_version: `[C]` int32, server version each client last read.
      read_iteration: `[C]` int32, iteration of each client's last read (0 = at init).
      next_event: `[C]` int32 (bernoulli mode; `[0]` otherwise), iteration of each client's
        next arrival.
    """

    k: jax.Array
    t: jax.Array
    version: jax.Array
    count: jax.Array
    read_version: jax.Array
    read_iteration: jax.Array
    next_event: jax.Array


class Tick(NamedTuple):
    """What happens in one iteration (output of `Events.draw`); `B` = number of slots.

    Attributes:
      ids: `[B]` int32 client of each slot (C = empty slot).
      active: `[B]` bool, the slot's client delivers its pending work and reads x_s now.
      due: `[B]` bool, the slot's arrival was drawn (active, or lost to unavailability).
      next_event: `[B]` int32, next arrival iteration of due slots (bernoulli mode).
      server: `[]` bool, a random server event happened.
      aggregate: `[]` bool, the server aggregates at the end of this iteration.
      k: `[]` int32, index of this iteration (state.k + 1).
      t: `[]` simulated time at the end of this iteration.
      tau: `[B]` int32, staleness in server versions of the delivered work (0 if inactive).
      tau_iter: `[B]` int32, staleness in iterations (iteration now - iteration of the read).
      overflow: `[]` int32, due clients deferred for lack of capacity.
      lost: `[]` int32, due clients that were unavailable.
      starts: `[B]` int32, clients that read x_s now and start training (C = none): the
        active slots' clients without a concurrency cap, the newly started ones with it.
      started: `[B]` bool, the slot of `starts` holds a starting client.
      start_next: `[B]` int32, next arrival iteration of the started clients (cap only).
      training: `[]` int32, clients training after this iteration (cap only; else -1).
    """

    ids: jax.Array
    active: jax.Array
    due: jax.Array
    next_event: jax.Array
    server: jax.Array
    aggregate: jax.Array
    k: jax.Array
    t: jax.Array
    tau: jax.Array
    tau_iter: jax.Array
    overflow: jax.Array
    lost: jax.Array
    starts: jax.Array
    started: jax.Array
    start_next: jax.Array
    training: jax.Array


def uniforms(key: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
    """`[B]` uniforms in [0, 1), one per id: the bits of `fold_in(key, id)`.

    One vectorised hash per call instead of a split + a draw per use: the random values of a
    client depend only on `(key, client id)` (so compacted and full steps agree), and a step
    compiles one threefry instance instead of several (each costs seconds on CPU)."""
    data = jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(key, i))(ids))
    bits = data[..., 0].astype(jnp.uint32)
    if jnp.dtype(dtype) == jnp.float64:
        return bits.astype(jnp.float64) * 2.0**-32
    return (bits >> 9).astype(jnp.float32) * jnp.float32(2.0**-23)


def _geometric(u: jax.Array, p: jax.Array) -> jax.Array:
    """Geometric(p) on {1, 2, ...} (iterations until the next arrival) from uniforms u."""
    gap = 1.0 + jnp.floor(jnp.log1p(-u) / jnp.log1p(-p))
    return jnp.clip(jnp.nan_to_num(gap, nan=1.0, posinf=_MAX_GAP), 1, _MAX_GAP).astype(jnp.int32)


def _bins(tau: jax.Array, num_bins: int) -> jax.Array:
    """Log2 bin of each staleness: 0 -> 0, [2^(b-1), 2^b) -> b, clipped to num_bins - 1."""
    bits = 32 - lax.clz(jnp.maximum(tau, 0).astype(jnp.int32))  # floor(log2 tau) + 1, 0 for 0
    return jnp.minimum(bits, num_bins - 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Events:
    """The asynchronous event engine: arrivals, aggregation rule, availability, capacity.

    Attributes:
      arrivals: who fires (`Arrivals.bernoulli/poisson/categorical`).
      aggregation: when the server aggregates (`Aggregation`; default every 4 deliveries).
      availability: optional on/off windows (`Availability`).
      capacity: slots per iteration (clients trained per iteration). "auto": 1 in
        categorical mode, else `min(C, ceil(m + 6 sqrt(m) + 8))` with m = sum_i p_i the
        expected number of due clients. None: all C slots (reference "compute all, mask").
      histogram_bins: bins of the log2 staleness histograms in the metrics (0: none).
      virtual_clock: the simulated time is a device model's virtual seconds
        (`device_model.event_model` sets it): the metrics add `virtual_time`, History's
        virtual-time column.
      concurrency: at most K clients train at any moment (None: every client trains all
        the time, the default). Bernoulli / Poisson arrivals only. Idle clients hold
        `next_event = NEVER`; at init K clients start (available ones first); each
        iteration the finishing clients (due: delivered or lost) go idle and up to
        `K - training` idle clients start, read x_s and draw their Geometric(p_i) gap.
        The starters are the first eligible (idle or finishing now, available at the
        iteration's time, distinct) of 4B + 16 candidates drawn uniformly with replacement
        (all C in a random order when that reaches C): uniform among the eligible, O(B)
        per iteration besides the `[C]` count of training clients. If fewer candidates are
        eligible the cap is refilled in later iterations. Metric `training`.
    """

    arrivals: Arrivals
    aggregation: Aggregation = Aggregation()
    availability: Availability | None = None
    capacity: int | Literal["auto"] | None = "auto"
    histogram_bins: int = 8
    virtual_clock: bool = False
    concurrency: int | None = None

    def __post_init__(self):
        c = self.arrivals.num_clients
        if self.concurrency is not None:
            k = self.concurrency
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= c:
                raise ValueError(f"concurrency must be an integer in [1, {c}], got {k!r}")
            if self.arrivals.mode != "bernoulli":
                raise ValueError(
                    f"concurrency needs bernoulli / Poisson arrivals, not {self.arrivals.mode!r}"
                )
        if self.capacity is not None and self.capacity != "auto":
            if int(self.capacity) != self.capacity or self.capacity < 1:
                raise ValueError(
                    f"capacity must be an integer >= 1 (or None/'auto'), got {self.capacity}"
                )
        if self.availability is not None and self.availability.num_clients != c:
            raise ValueError(
                f"availability covers {self.availability.num_clients} clients, arrivals {c}"
            )
        if self.aggregation.rule == "random" and self.bernoulli:
            if not 0 < self.aggregation.p <= 1:
                raise ValueError(
                    f"server event probability p_s must be in (0, 1], got {self.aggregation.p}"
                )
        if self.histogram_bins < 0:
            raise ValueError(f"histogram_bins must be >= 0, got {self.histogram_bins}")

    # ---------------------------------------------------------------- properties
    @property
    def num_clients(self) -> int:
        return self.arrivals.num_clients

    @property
    def bernoulli(self) -> bool:
        """Iterations of `dt` in which any number of clients may fire (bernoulli, forced)."""
        return self.arrivals.mode != "categorical"

    @property
    def slots(self) -> int:
        """B, the number of slots per iteration."""
        c = self.num_clients
        if self.capacity is None:
            return c
        if self.capacity == "auto":
            if not self.bernoulli:
                return 1
            if self.arrivals.mask is not None:
                return max(1, int(self.arrivals.mask.sum(1).max()))
            if self.concurrency is not None:  # at most K are due: K times the largest p
                m = float(self.concurrency * self.arrivals.values.max())
                return min(self.concurrency, math.ceil(m + 6.0 * math.sqrt(m) + 8.0))
            m = float(self.arrivals.values.sum())
            return min(c, math.ceil(m + 6.0 * math.sqrt(m) + 8.0))
        return min(int(self.capacity), c)

    def probabilities(self) -> tuple[np.ndarray, float]:
        """`(p [C], p_s)`: per-iteration probability that client i / the server has an event."""
        a = self.arrivals
        if self.bernoulli:
            p_s = self.aggregation.p if self.aggregation.rule == "random" else 0.0
            return a.values, p_s
        lam_s = self.aggregation.p if self.aggregation.rule == "random" else 0.0
        total = a.values.sum() + lam_s
        return a.values / total, lam_s / total

    # ---------------------------------------------------------------- engine
    def init(self, key: jax.Array) -> EventState:
        """Every client reads the initial model at iteration 0 (version 0)."""
        c = self.num_clients
        ftype = jax.dtypes.canonicalize_dtype(jnp.float64)
        if self.arrivals.mode == "bernoulli":
            p = jnp.asarray(self.arrivals.values, ftype)
            next_event = _geometric(uniforms(key, jnp.arange(c), ftype), p)
            if self.concurrency is not None:  # K clients start, available ones first
                ids = jnp.arange(c)
                score = uniforms(jax.random.fold_in(key, 1), ids, ftype)
                if self.availability is not None:
                    score = score + self.availability.at(jnp.zeros((), ftype), ids)
                _, first = lax.top_k(score, self.concurrency)
                idle = jnp.full((c,), NEVER, jnp.int32)
                next_event = idle.at[first].set(next_event[first])
        else:
            next_event = jnp.zeros((0,), jnp.int32)
        zeros = lambda: jnp.zeros((c,), jnp.int32)  # distinct buffers: the state is donatable
        return EventState(
            k=jnp.int32(0),
            t=jnp.zeros((), ftype),
            version=jnp.int32(0),
            count=jnp.int32(0),
            read_version=zeros(),
            read_iteration=zeros(),
            next_event=next_event,
        )

    def draw(self, state: EventState, key: jax.Array) -> Tick:
        """The events of iteration `state.k + 1` (pure function of `(state, key)`)."""
        c, b = self.num_clients, self.slots
        k_new = state.k + 1
        ftype = state.t.dtype
        if self.bernoulli:
            t_new = k_new.astype(ftype) * self.arrivals.dt
            forced = self.arrivals.mask
            if forced is not None:
                due_all = jnp.asarray(forced)[state.k % forced.shape[0]]
            else:
                due_all = state.next_event <= k_new
            if b == c:
                ids = jnp.arange(c, dtype=jnp.int32)
            elif forced is not None:
                ids = compact(due_all, b)
            else:
                overdue = state.next_event < k_new
                ids = lax.cond(
                    jnp.any(overdue),
                    lambda: compact_first(overdue, due_all & ~overdue, b),
                    lambda: compact(due_all, b),
                )
            safe = jnp.minimum(ids, c - 1)
            due = gather_rows(due_all, ids) & (ids < c)
            p = jnp.asarray(self.arrivals.values, ftype)[safe]
            u = uniforms(key, jnp.append(safe, c), ftype)  # clients, then the server
            gap = jnp.minimum(_geometric(u[:-1], p), 2**31 - 1 - k_new)
            next_event = jnp.where(due, k_new + gap, 0)
            server = (
                u[-1] < self.aggregation.p
                if self.aggregation.rule == "random"
                else jnp.bool_(False)
            )
            overflow = jnp.sum(due_all) - jnp.sum(due)
            if self.concurrency is not None:
                starts, started, start_next, training = self._starts(
                    state, key, ids, due, k_new, t_new
                )
        else:
            p, p_s = self.probabilities()
            cdf = np.cumsum(np.append(p, p_s))
            u = uniforms(key, jnp.arange(2), ftype)
            j = jnp.minimum(
                jnp.searchsorted(jnp.asarray(cdf, ftype), u[0] * cdf[-1], side="right"),
                c if p_s > 0 else c - 1,
            ).astype(jnp.int32)
            server = j == c
            rate = float(self.arrivals.values.sum()) + (
                self.aggregation.p if self.aggregation.rule == "random" else 0.0
            )
            t_new = state.t - jnp.log1p(-u[1]) / rate  # + Exp(rate)
            if b == c:
                ids = jnp.arange(c, dtype=jnp.int32)
                due = ids == j
            else:
                ids = jnp.full((b,), c, jnp.int32).at[0].set(j)
                due = ids < c
            next_event = jnp.zeros((b,), jnp.int32)
            overflow = jnp.int32(0)
            safe = jnp.minimum(ids, c - 1)
        if self.availability is not None:
            active = due & self.availability.at(t_new, ids)
        else:
            active = due
        delivered = jnp.sum(active)
        rule = self.aggregation.rule
        if rule == "count":
            aggregate = state.count + delivered >= self.aggregation.delta
        elif rule == "random":
            aggregate = server
        else:
            interval = self.aggregation.interval
            aggregate = jnp.floor(t_new / interval) > jnp.floor(state.t / interval)
        tau = jnp.where(active, state.version - gather_rows(state.read_version, ids), 0)
        tau_iter = jnp.where(active, k_new - gather_rows(state.read_iteration, ids), 0)
        if self.concurrency is None:
            starts, started, start_next, training = ids, active, next_event, jnp.int32(-1)
        return Tick(
            ids=ids,
            active=active,
            due=due,
            next_event=next_event,
            server=server,
            aggregate=aggregate,
            k=k_new,
            t=t_new,
            tau=tau,
            tau_iter=tau_iter,
            overflow=overflow.astype(jnp.int32),
            lost=jnp.sum(due & ~active).astype(jnp.int32),
            starts=starts,
            started=started,
            start_next=start_next,
            training=training,
        )

    def _starts(self, state, key, ids, due, k_new, t_new):
        """`(starts [B], started [B], start_next [B], training [])` under the concurrency
        cap: up to `K - training` idle clients start (class docstring)."""
        c, b = self.num_clients, ids.shape[0]
        ftype = state.t.dtype
        training = jnp.sum(state.next_event < NEVER) - jnp.sum(due)
        wanted = jnp.clip(self.concurrency - training, 0, b)
        r = 4 * b + 16
        k_cand, k_gap = jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)
        if r >= c:  # all clients, in a random order
            _, cand = lax.top_k(uniforms(k_cand, jnp.arange(c), ftype), c)
            cand, r = cand.astype(jnp.int32), c
            distinct = jnp.ones((r,), bool)
        else:  # r uniform draws with replacement; repeats are not eligible
            u = uniforms(k_cand, jnp.arange(r), ftype)
            cand = jnp.minimum((u * c).astype(jnp.int32), c - 1)
            earlier = jnp.tril(cand[:, None] == cand[None, :], k=-1)
            distinct = ~jnp.any(earlier, axis=1)
        finishing = jnp.any((cand[:, None] == ids[None, :]) & due[None, :], axis=1)
        eligible = distinct & ((gather_rows(state.next_event, cand) >= NEVER) | finishing)
        if self.availability is not None:
            eligible = eligible & self.availability.at(t_new, cand)
        sel = compact(eligible, b)  # the first b eligible candidates, in draw order
        starts = cand[jnp.minimum(sel, r - 1)]
        started = (sel < r) & (jnp.arange(b) < wanted)
        p = jnp.asarray(self.arrivals.values, ftype)[starts]
        gap = jnp.minimum(_geometric(uniforms(k_gap, starts, ftype), p), NEVER - 1 - k_new)
        starts = jnp.where(started, starts, c).astype(jnp.int32)
        start_next = jnp.where(started, k_new + gap, NEVER)
        return starts, started, start_next, (training + jnp.sum(started)).astype(jnp.int32)

    def advance(
        self, state: EventState, tick: Tick, *, read_after_aggregate: bool = False
    ) -> EventState:
        """Bookkeeping after the iteration: active clients read (version before the
        aggregation, or after it with `read_after_aggregate`), due clients are rescheduled,
        the delivery count resets at an aggregation."""
        read_version = state.version + (tick.aggregate if read_after_aggregate else 0)
        count = state.count + jnp.sum(tick.active).astype(jnp.int32)
        next_event = state.next_event
        if self.arrivals.mode == "bernoulli":
            if self.concurrency is None:
                next_event = scatter_rows(next_event, tick.ids, tick.due, tick.next_event)
            else:  # the finishing go idle, then the starters are scheduled
                idle = jnp.full(tick.ids.shape, NEVER, jnp.int32)
                next_event = scatter_rows(next_event, tick.ids, tick.due, idle)
                next_event = scatter_rows(next_event, tick.starts, tick.started, tick.start_next)
        slots = tick.starts.shape
        return EventState(
            k=tick.k,
            t=tick.t,
            version=state.version + tick.aggregate.astype(jnp.int32),
            count=jnp.where(tick.aggregate, 0, count).astype(jnp.int32),
            read_version=scatter_rows(
                state.read_version,
                tick.starts,
                tick.started,
                jnp.broadcast_to(read_version, slots),
            ),
            read_iteration=scatter_rows(
                state.read_iteration, tick.starts, tick.started, jnp.broadcast_to(tick.k, slots)
            ),
            next_event=next_event,
        )

    def metrics(self, tick: Tick) -> dict[str, jax.Array]:
        """Per-iteration metrics: time, firings, overflow, staleness mean/max/histogram (and
        `virtual_time`, the time again, with `virtual_clock`)."""
        fired = jnp.sum(tick.active).astype(jnp.int32)
        denom = jnp.maximum(fired, 1).astype(jnp.float32)
        out = {
            "t": tick.t,
            "fired": fired,
            "overflow": tick.overflow,
            "lost": tick.lost,
            "aggregated": tick.aggregate.astype(jnp.int32),
            "tau_mean": jnp.sum(tick.tau).astype(jnp.float32) / denom,
            "tau_max": jnp.max(tick.tau),
            "tau_iter_mean": jnp.sum(tick.tau_iter).astype(jnp.float32) / denom,
            "tau_iter_max": jnp.max(tick.tau_iter),
        }
        nb = self.histogram_bins
        if nb:
            for name, tau in (("tau_hist", tick.tau), ("tau_iter_hist", tick.tau_iter)):
                onehot = jax.nn.one_hot(_bins(tau, nb), nb, dtype=jnp.int32)
                out[name] = jnp.sum(onehot * tick.active[:, None], axis=0)
        if self.virtual_clock:
            out["virtual_time"] = tick.t
        if self.concurrency is not None:
            out["training"] = tick.training
        return out

    def completion_times(self, key: jax.Array, ids: jax.Array) -> jax.Array:
        """`[M]` time until each client's next arrival from now (memoryless clocks):
        Geometric(p_i) * dt in bernoulli mode, Exp(lambda_i) in categorical mode (the
        completion time of a synchronous round's client). Keys are per client."""
        ftype = jax.dtypes.canonicalize_dtype(jnp.float64)
        u = uniforms(key, ids, ftype)
        a = self.arrivals
        if self.bernoulli:
            return _geometric(u, jnp.asarray(a.values, ftype)[ids]).astype(ftype) * a.dt
        return -jnp.log1p(-u) / jnp.asarray(a.values, ftype)[ids]


def staleness_bins(num_bins: int) -> list[str]:
    """Labels of the log2 staleness histogram bins: "0", "1", "2-3", "4-7", ..., "2^(b-2)+"."""
    labels = ["0"]
    for b in range(1, num_bins):
        lo, hi = 2 ** (b - 1), 2**b - 1
        labels.append(f"{lo}+" if b == num_bins - 1 else (str(lo) if lo == hi else f"{lo}-{hi}"))
    return labels
