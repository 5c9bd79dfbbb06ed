"""Device profiles and the virtual clock of synchronous rounds (issue 38, items 1 and 2).

A client's **profile** (`Profile`, one value per client):

| field | unit | meaning |
|---|---|---|
| `speed` | local steps / s | compute speed (one step = one minibatch of the round's `LocalSpec`) |
| `uplink` | bytes / s | upload bandwidth |
| `downlink` | bytes / s | download bandwidth |
| `period` | s | length of the availability cycle (86400: diurnal) |
| `session` | s | online during the first `session` seconds of each cycle (`>= period`: always) |
| `phase` | s | the cycle's offset: online at time t iff `(t + phase) mod period < session` |
| `dropout` | probability | the client vanishes during a round it started (per round) |

Profiles come from
- a **trace** (`TraceProfiles`, `load_trace`): a table of R profiles; client `i` gets row
  `i mod R` (`assignment="modulo"`) or a keyed hash of `i` (`"hash"`), so C may exceed R;
- **procedural** draws (`ProceduralProfiles`): a pure function of `(seed, client id)` from
  named distributions (`lognormal`, `uniform`, `constant`); nothing of size C exists, so
  10^9 clients cost what the cohort costs.

Both are called on a cohort's ids inside the compiled step: `profiles(ids [B]) -> Profile`
of `[B]` arrays.

**Trace format** (CSV, UTF-8; `save_trace` writes it, `load_trace` reads it):

    # fedjax_sim device trace v1           <- optional comment lines start with '#'
    client,speed,uplink,downlink,period,session,phase,dropout
    0,4.21,1250000,5400000,86400,28800,3600,0.02
    1,...

One header row naming exactly the columns `client` and the seven fields above (any order), then
one row per profile; `client` runs over 0..R-1, each value once (rows may come in any order).
Values: `speed`, `uplink`, `downlink`, `period`, `session` finite and > 0; `phase` finite;
`dropout` in [0, 1). A malformed file raises `ValueError("path, line L, column 'name': ...")`.
The bundled `device_traces/small.csv` (`bundled_trace()`, 64 rows, made by
`tools/make_device_trace.py` from `ProceduralProfiles(seed=38)` at its defaults) is for tests
and examples. FedScale's device-capacity and behaviour traces are not read (their pickled
formats are not documented here; convert them to this CSV).

The **virtual clock** (`DeviceModel`, the `device_model` option of `compose` and every
synchronous preset): client i's time in a round is

    time_i = bytes_down / downlink_i + steps_i / speed_i + bytes_up / uplink_i
             + (R - 1) * round_trip_latency

with the bytes one client receives and sends in that round (the `bytes_down` / `bytes_up`
metrics per client: the model and the hooks' broadcasts; the aggregator's wire format, so
compression shortens uploads and secure aggregation's keys, shares and masked vector
lengthen them), its local steps (after FedProx's stragglers) and the upload protocol's R
server round trips (`Aggregator.round_trips`: 1, secure aggregation's 4; each extra one costs
`round_trip_latency`, default 0.1 s, an assumed mobile round trip). comm_i below is the
transfer time plus that latency. A round
starting at virtual time t0:
1. a selected client that is offline at t0 (its window) does not take part (`unavailable`);
2. with a `deadline` D, a client with time_i > D is `late`: dropped (`late="drop"`, weight 0)
   or, as FedProx's stragglers, does the steps that fit (`late="partial"`:
   `floor((D - comm_i) * speed_i)` of them, comm_i its transfer time; dropped if none fit);
3. a client drops out during its round (`dropouts`) with probability `dropout_i`, or when its
   online window closes before it finishes (`(t0 + phase) mod period + time_i > session`);
4. with `over_selection` f > 1 (Bonawitz et al. 2019), the cohort sampler draws ceil(f M)
   clients and the round keeps the first M to finish (the fastest; ties: the first slot);
   the others are aborted (they downloaded, they do not train);
5. the round lasts as long as its slowest reporting client (`round_time`), or D when a
   deadline is set and fewer than min(M, selected and online) clients report (the server
   waits for the deadline); a round in which nobody reports lasts D, or `idle` seconds
   without a deadline. The state's clock advances by it; `virtual_time` is the clock after
   the round (History's virtual-time column).

**Availability-aware cohorts** (`cohort="available"`; default `"all"`, the sampler above,
bit for bit as before): the drawn cohort of N (= ceil(f M)) is drawn among the clients online
at the round's start t0 instead of among all C. The cohort sampler (uniform or proportional,
from the round's cohort key) draws K = ceil(g N) **candidates** (`candidates` g >= 1, default
8; at most C without replacement, and when K reaches C all C clients in a random order); only
their profiles are evaluated (`online` at t0) and the cohort is the first N online candidates
in draw order (`available_slots`, a top-k over draw positions, O(K)). Without replacement the
draw order is a uniformly random ordering, so the cohort is uniform without replacement among
the online clients (with replacement: i.i.d. draws from the sampler restricted to the online
ones); memory O(K), so procedural profiles at 10^9 clients still cost only the candidates.
If fewer than N candidates are online, the first offline candidates fill the cohort and the
round counts them as `unavailable` (it runs with fewer; P(short) is a binomial tail in K and
the online fraction: raise g for sparse windows). Trace profiles use the same candidate rule
(not an exact draw over all rows). Over-selection and deadlines then apply to the drawn
cohort as above. Bernoulli cohorts and distributors are refused; a streamed run
(`run.streaming`) would have to plan the K candidates: not supported by the CLI, untested.

Asynchronous algorithms fire from the same profiles: `event_model(profiles, C, steps=...,
bytes_down=..., bytes_up=...)` is an `events.Events` whose Poisson rates are
`(1 - dropout_i) / time_i` and whose availability windows are the profiles'.

Clients that do not take part get weight 0 (as FedAvg's dropped stragglers), so a round where
nobody reports leaves the model unchanged. All draws are masked operations inside the one
compiled step, keyed by `round_key(key, t, DEVICES)` and the client id: bit-reproducible and
independent of cohort order. Deviations, documented: a selected client counts as downloading
only if it is online and has weight > 0 (data, sampled); a failed client (dropout, late) never
uploads; without a deadline, the server detects failures at once (no timeout).
`over_selection` is static (it sets the drawn cohort's shape); `deadline` may be traced (a
sweep's grid). A streamed run (`run.streaming`) with over-selection must plan the drawn
cohorts (`AlgorithmCohorts(CohortSpec(size=ceil(f M)))`); `UniformCohorts` plans give clients
slot ids, so their profiles would be those of the slots: not supported.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from importlib import resources
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms.core import CohortSpec, client_key, float_dtype
from fedjax_sim.algorithms.events import (
    Aggregation,
    Arrivals,
    Availability,
    Events,
    compact_first,
)
from fedjax_sim.core.checks import check_number, positive

FIELDS = ("speed", "uplink", "downlink", "period", "session", "phase", "dropout")
DAY = 86400.0
ROUND_TRIP_LATENCY = 0.1  # seconds per extra protocol round trip (an assumed mobile RTT)


class Profile(NamedTuple):
    """Device profiles of some clients, one entry per client (see the module docstring)."""

    speed: Any  # local steps per second
    uplink: Any  # bytes per second
    downlink: Any  # bytes per second
    period: Any  # seconds per availability cycle
    session: Any  # online seconds at the start of each cycle
    phase: Any  # seconds: online iff (t + phase) mod period < session
    dropout: Any  # probability of vanishing during a round


def _field_problem(name: str, value: float) -> str | None:
    """What is wrong with a profile value (None if fine)."""
    if not math.isfinite(value):
        return "must be finite"
    if name in ("speed", "uplink", "downlink", "period", "session") and not value > 0:
        return "must be > 0"
    if name == "dropout" and not 0.0 <= value < 1.0:
        return "must be in [0, 1)"
    return None


# ------------------------------------------------------------------------------ availability
def online(profile: Profile, t: jax.Array) -> jax.Array:
    """Whether each client is online at virtual time `t`: `(t + phase) mod period < session`."""
    return jnp.mod(t + profile.phase, profile.period) < profile.session


def online_left(profile: Profile, t: jax.Array) -> jax.Array:
    """Seconds each client stays online after `t` (inf if always online, 0 if offline)."""
    pos = jnp.mod(t + profile.phase, profile.period)
    left = jnp.maximum(profile.session - pos, 0.0)
    return jnp.where(profile.session >= profile.period, jnp.inf, left)


def client_times(profile: Profile, steps: jax.Array, bytes_down: Any, bytes_up: Any) -> jax.Array:
    """`bytes_down / downlink + steps / speed + bytes_up / uplink` per client (seconds)."""
    return bytes_down / profile.downlink + steps / profile.speed + bytes_up / profile.uplink


# ------------------------------------------------------------------------------ traces
@dataclasses.dataclass(frozen=True, eq=False)
class TraceProfiles:
    """A table of R profiles (`Profile` of `[R]` float64 NumPy arrays); client i gets row
    `i mod R` (`assignment="modulo"`) or row `hash(seed, i) mod R` (`"hash"`)."""

    table: Profile
    assignment: Literal["modulo", "hash"] = "modulo"
    seed: int = 0

    def __post_init__(self):
        if self.assignment not in ("modulo", "hash"):
            raise ValueError(f"trace assignment must be modulo|hash, got {self.assignment!r}")
        table = Profile(*(np.asarray(v, np.float64).reshape(-1) for v in self.table))
        sizes = {v.size for v in table}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"a trace needs R >= 1 rows in every field, got sizes {sizes}")
        for name, values in zip(FIELDS, table, strict=True):
            for r, v in enumerate(values):
                problem = _field_problem(name, float(v))
                if problem:
                    raise ValueError(f"trace row {r}, {name} {problem}, got {v}")
        object.__setattr__(self, "table", table)

    @property
    def rows(self) -> int:
        return int(self.table.speed.size)

    def row_of(self, ids: jax.Array) -> jax.Array:
        """`[B]` the trace row of each client."""
        ids = jnp.asarray(ids)
        if self.assignment == "modulo":
            return (ids % self.rows).astype(jnp.int32)
        base = jax.random.key(self.seed)
        data = jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(base, i))(ids))
        return (data[..., -1].astype(jnp.uint32) % jnp.uint32(self.rows)).astype(jnp.int32)

    def __call__(self, ids: jax.Array) -> Profile:
        rows = self.row_of(ids)
        dtype = float_dtype()
        return Profile(*(jnp.asarray(v, dtype)[rows] for v in self.table))


def save_trace(profile: Profile, path: Any, *, comment: str | None = None) -> None:
    """Writes a `Profile` of `[R]` values as the CSV trace format (client ids 0..R-1)."""
    values = [np.asarray(v, np.float64).reshape(-1) for v in profile]
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write("# fedjax_sim device trace v1\n")
        if comment:
            for line in comment.splitlines():
                f.write(f"# {line}\n")
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(("client", *FIELDS))
        for r in range(values[0].size):
            writer.writerow((r, *(repr(float(v[r])) for v in values)))


def read_trace(path: Any) -> Profile:
    """The `Profile` of `[R]` float64 arrays of a CSV trace (rows ordered by client id).
    Raises `ValueError` naming the file, line and column of the first problem."""
    path = str(path)
    header, rows = None, {}
    with open(path, newline="", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            cells = next(csv.reader([line]))
            cells = [c.strip() for c in cells]
            if header is None:
                expected = {"client", *FIELDS}
                if len(set(cells)) != len(cells) or set(cells) != expected:
                    missing, extra = expected - set(cells), set(cells) - expected
                    raise ValueError(
                        f"{path}, line {line_no}: the header must name the columns "
                        f"{', '.join(('client', *FIELDS))} once each (missing "
                        f"{sorted(missing)}, unknown {sorted(extra)})"
                    )
                header = cells
                continue
            if len(cells) != len(header):
                raise ValueError(
                    f"{path}, line {line_no}: {len(cells)} values for {len(header)} columns"
                )
            record = {}
            for name, cell in zip(header, cells, strict=True):
                where = f"{path}, line {line_no}, column {name!r}"
                if name == "client":
                    if not cell.isdigit():
                        raise ValueError(f"{where}: a client id is an integer >= 0, got {cell!r}")
                    record[name] = int(cell)
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    raise ValueError(f"{where}: not a number: {cell!r}") from None
                problem = _field_problem(name, value)
                if problem:
                    raise ValueError(f"{where}: {name} {problem}, got {cell}")
                record[name] = value
            cid = record.pop("client")
            if cid in rows:
                raise ValueError(
                    f"{path}, line {line_no}, column 'client': client {cid} appears twice"
                )
            rows[cid] = record
    if header is None or not rows:
        raise ValueError(f"{path}: no header and profile rows")
    if sorted(rows) != list(range(len(rows))):
        missing = sorted(set(range(len(rows))) - set(rows))
        raise ValueError(
            f"{path}, column 'client': the ids must be 0..{len(rows) - 1}, missing {missing[:5]}"
        )
    return Profile(*(np.array([rows[r][n] for r in range(len(rows))]) for n in FIELDS))


def load_trace(
    path: Any, *, assignment: Literal["modulo", "hash"] = "modulo", seed: int = 0
) -> TraceProfiles:
    """`TraceProfiles` of a CSV trace (format in the module docstring)."""
    return TraceProfiles(read_trace(path), assignment, seed)


def bundled_trace() -> Any:
    """Path of the bundled 64-row trace `device_traces/small.csv` (for tests and examples)."""
    return resources.files("fedjax_sim.algorithms").joinpath("device_traces", "small.csv")


# ------------------------------------------------------------------------------ procedural
@dataclasses.dataclass(frozen=True)
class Distribution:
    """A named distribution of one profile field: `lognormal(median, sigma)`,
    `uniform(low, high)` or `constant(value)`."""

    kind: Literal["lognormal", "uniform", "constant"]
    a: float
    b: float = 0.0

    def __post_init__(self):
        for name, v in (("a", self.a), ("b", self.b)):
            check_number(f"{self.kind} parameter {name}", v, math.isfinite, "finite")
        if self.kind == "lognormal":
            positive("lognormal median", self.a)
            check_number("lognormal sigma", self.b, lambda v: v >= 0, ">= 0")
        elif self.kind == "uniform":
            if not self.a <= self.b:
                raise ValueError(f"uniform(low, high) needs low <= high, got {self.a}, {self.b}")
        elif self.kind != "constant":
            raise ValueError(f"distribution must be lognormal|uniform|constant, got {self.kind!r}")

    def sample(self, key: jax.Array, dtype: Any) -> jax.Array:
        """One draw (a scalar) from `key`."""
        if self.kind == "lognormal":
            z = jax.random.normal(key, (), dtype)
            return jnp.asarray(self.a, dtype) * jnp.exp(self.b * z)
        if self.kind == "uniform":
            return jax.random.uniform(key, (), dtype, self.a, self.b)
        return jnp.asarray(self.a, dtype)

    def mean(self) -> float:
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def variance(self) -> float:
        if self.kind == "lognormal":
            return (math.exp(self.b**2) - 1) * self.a**2 * math.exp(self.b**2)
        return (self.b - self.a) ** 2 / 12 if self.kind == "uniform" else 0.0


def lognormal(median: float, sigma: float) -> Distribution:
    """`median * exp(sigma * N(0, 1))`."""
    return Distribution("lognormal", float(median), float(sigma))


def uniform(low: float, high: float) -> Distribution:
    return Distribution("uniform", float(low), float(high))


def constant(value: float) -> Distribution:
    return Distribution("constant", float(value))


@dataclasses.dataclass(frozen=True)
class ProceduralProfiles:
    """Profiles drawn from named distributions, a pure function of `(seed, client id)`:
    field k of client i is drawn from `fold_in(fold_in(key(seed), i), k)`.

    The defaults are illustrative round numbers (not fitted to a trace): phones of ~2 local
    steps/s (log-normal, sigma 0.8), ~1 MB/s up and ~5 MB/s down (log-normal, sigma 1), a
    diurnal window of 4-12 hours at a uniform phase, and a 2 % chance of vanishing mid-round.
    Draws outside a field's range (a `dropout` >= 1) are clipped into it."""

    seed: int = 0
    speed: Distribution = lognormal(2.0, 0.8)
    uplink: Distribution = lognormal(1.0e6, 1.0)
    downlink: Distribution = lognormal(5.0e6, 1.0)
    period: Distribution = constant(DAY)
    session: Distribution = uniform(4 * 3600.0, 12 * 3600.0)
    phase: Distribution = uniform(0.0, DAY)
    dropout: Distribution = constant(0.02)

    def __post_init__(self):
        for name in FIELDS:
            dist = getattr(self, name)
            if not isinstance(dist, Distribution):
                raise TypeError(f"{name} must be a Distribution (lognormal, uniform, constant)")
            low = dist.a if dist.kind != "lognormal" else None
            if name in ("speed", "uplink", "downlink", "period", "session") and (
                low is not None and not low > 0
            ):
                raise ValueError(f"{name} must be > 0: its distribution starts at {low}")
            if name == "dropout" and (dist.kind == "lognormal" or not 0 <= dist.a < 1):
                raise ValueError("dropout must be a constant or uniform in [0, 1)")

    def __call__(self, ids: jax.Array) -> Profile:
        dtype = float_dtype()
        base = jax.random.key(self.seed)

        def one(i):
            k = jax.random.fold_in(base, i)
            return [
                getattr(self, n).sample(jax.random.fold_in(k, j), dtype)
                for j, n in enumerate(FIELDS)
            ]

        values = jax.vmap(one)(jnp.asarray(ids))
        profile = Profile(*values)
        top = jnp.asarray(1.0, dtype) - jnp.finfo(dtype).eps
        return profile._replace(dropout=jnp.clip(profile.dropout, 0.0, top))


Profiles = TraceProfiles | ProceduralProfiles

# Named procedural profiles (`named_profiles`, the CLI's `--device-model NAME`): illustrative,
# not fitted to a trace.
PROFILES: dict[str, dict[str, Distribution]] = {
    # ProceduralProfiles' defaults: log-normal speeds and bandwidths, diurnal windows, dropout
    "phones": {},
    # the same speeds and bandwidths, always online, never vanishing
    "always_on": {"session": constant(DAY), "phase": constant(0.0), "dropout": constant(0.0)},
    # identical devices (2 steps/s, 1 MB/s up, 5 MB/s down), always online, no dropout
    "homogeneous": {
        "speed": constant(2.0),
        "uplink": constant(1.0e6),
        "downlink": constant(5.0e6),
        "session": constant(DAY),
        "phase": constant(0.0),
        "dropout": constant(0.0),
    },
}
BUNDLED = "bundled"  # `named_profiles("bundled")`: the bundled 64-row trace


def named_profiles(spec: str, seed: int = 0) -> Profiles:
    """Profiles by name: a `PROFILES` name (procedural, drawn from `seed`), "bundled" (the
    bundled trace, `bundled_trace()`) or the path of a CSV trace (`load_trace`, rows
    assigned modulo). Raises ValueError (one line) for anything else or a malformed trace."""
    if spec in PROFILES:
        return ProceduralProfiles(seed, **PROFILES[spec])
    if spec == BUNDLED:
        return load_trace(bundled_trace())
    import os

    if not os.path.isfile(spec):
        raise ValueError(
            f"{spec!r} is neither a profile name ({', '.join([*PROFILES, BUNDLED])}) nor a "
            "trace file (CSV)"
        )
    return load_trace(spec)


# ------------------------------------------------------------------------------ the clock
class Plan(NamedTuple):
    """A round under the device model (`DeviceModel.plan`): the kept cohort slots and who
    reports."""

    slots: jax.Array  # [M] positions in the drawn cohort (over-selection keeps M of them)
    weights: jax.Array  # [M] aggregation weights (0: does not report)
    num_steps: jax.Array  # [M] local steps (fewer for late clients under late="partial")
    times: jax.Array  # [M] each kept client's time (inf if it does not report)
    round_time: jax.Array  # []
    clock: jax.Array  # [] virtual time after the round
    downloads: jax.Array  # [] clients that received the model
    metrics: dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceModel:
    """Device profiles plus the synchronous round's rules on the virtual clock (module
    docstring): `deadline` (seconds, None: none), `late` ("drop" | "partial"),
    `over_selection` (f >= 1: draw ceil(f M), keep the first M to finish), `availability`
    (offline clients at the round's start do not take part), `idle` (seconds a round
    lasts when nobody reports and there is no deadline), `round_trip_latency` (seconds
    each extra server round trip of the upload protocol adds to a client's time: secure
    aggregation's 3 beyond the plain upload; default 0.1 s, an assumed mobile round trip,
    not a measurement), `cohort` ("all": the cohort is drawn among all clients, the
    default; "available": among the clients online at the round's start, drawn from
    `candidates` (g >= 1) times as many candidates: module docstring)."""

    profiles: Profiles = ProceduralProfiles()
    deadline: float | None = None
    late: Literal["drop", "partial"] = "drop"
    over_selection: float = 1.0
    availability: bool = True
    idle: float = 60.0
    round_trip_latency: float = ROUND_TRIP_LATENCY
    cohort: Literal["all", "available"] = "all"
    candidates: float = 8.0

    def __post_init__(self):
        if not isinstance(self.profiles, (TraceProfiles, ProceduralProfiles)):
            raise TypeError("profiles must be TraceProfiles (load_trace) or ProceduralProfiles")
        if self.deadline is not None:
            positive("deadline", self.deadline)
        if self.late not in ("drop", "partial"):
            raise ValueError(f"late must be drop|partial, got {self.late!r}")
        check_number(
            "over_selection", self.over_selection, lambda v: 1 <= v < math.inf, "finite and >= 1"
        )
        positive("idle", self.idle)
        check_number(
            "round_trip_latency",
            self.round_trip_latency,
            lambda v: 0 <= v < math.inf,
            "finite and >= 0",
        )
        if self.cohort not in ("all", "available"):
            raise ValueError(f"cohort must be all|available, got {self.cohort!r}")
        check_number("candidates", self.candidates, lambda v: 1 <= v < math.inf, "finite and >= 1")
        if self.cohort == "available" and not self.availability:
            raise ValueError(
                "cohort='available' needs availability=True (without it every client is online)"
            )

    def candidate_size(self, size: int, num_clients: int, *, replace: bool = False) -> int:
        """Candidates drawn for an availability-aware cohort of `size`:
        ceil(candidates * size), at most `num_clients` unless drawn with replacement."""
        k = int(math.ceil(self.candidates * size - 1e-9))
        return k if replace else min(k, num_clients)

    def available_slots(self, clock: jax.Array, ids: jax.Array, size: int) -> jax.Array:
        """`[size]` positions in the candidates `ids [K]` (in draw order) of an
        availability-aware cohort: the first `size` candidates online at virtual time
        `clock`, in draw order, then (when fewer are online) the first offline ones, which
        the round counts as `unavailable`. O(K): only the candidates' profiles are drawn."""
        k = ids.shape[0]
        if not 1 <= size <= k:
            raise ValueError(f"an available cohort of {size} needs 1..{k} candidates")
        on = online(self.profiles(ids), jnp.asarray(clock, float_dtype()))
        return compact_first(on, ~on, size)

    def available_cohort(
        self, clock: jax.Array, key: jax.Array, cohort: CohortSpec, counts: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """`(ids [N], weights [N])`: the drawn cohort of `cohort.size` = N among the clients
        online at `clock` (`cohort="available"`). K = `candidate_size(N, C)` candidates are
        drawn by the cohort's sampling from `key` (uniform: all C in a random order when K
        reaches C), then `available_slots` keeps the first N online."""
        cohort.check(counts.shape[0])
        replace = cohort.sampling == "proportional"
        k = self.candidate_size(cohort.size, counts.shape[0], replace=replace)
        ids, weights = dataclasses.replace(cohort, size=k).sample(key, counts)
        if not replace and k == counts.shape[0]:  # all clients, in id order: shuffle them
            order = jax.random.permutation(jax.random.fold_in(key, 1), k)
            ids, weights = ids[order], weights[order]
        slots = self.available_slots(clock, ids, cohort.size)
        return ids[slots], weights[slots]

    def selection_size(self, size: int) -> int:
        """Clients drawn for a round that keeps `size`: ceil(over_selection * size)."""
        return int(math.ceil(self.over_selection * size - 1e-9))

    def init(self) -> jax.Array:
        """The clock at the start of a run: 0 seconds."""
        return jnp.zeros((), float_dtype())

    def plan(
        self,
        clock: jax.Array,
        key: jax.Array,
        ids: jax.Array,
        weights: jax.Array,
        num_steps: jax.Array,
        *,
        keep: int,
        bytes_down: float,
        bytes_up: float | jax.Array,
        round_trips: int = 1,
    ) -> Plan:
        """The round starting at virtual time `clock` for the drawn cohort `ids [N]` with
        `weights [N]` and local steps `num_steps [N]`; keeps `keep` (= M <= N) slots; `key`:
        `round_key(key, t, DEVICES)`; `bytes_down` / `bytes_up`: what one client receives /
        sends this round (`bytes_up` may be `[N]`, per client: HetLoRA's ranks);
        `round_trips`: the upload protocol's server round trips (the aggregator's; each one
        beyond the first adds `round_trip_latency`)."""
        dtype = float_dtype()
        clock = jnp.asarray(clock, dtype)
        profile = self.profiles(ids)
        steps = num_steps.astype(dtype)
        comm = bytes_down / profile.downlink + bytes_up / profile.uplink
        if round_trips > 1:  # e.g. secure aggregation's key exchange and unmasking
            comm = comm + (round_trips - 1) * self.round_trip_latency
        times = comm + steps / profile.speed
        selected = weights > 0
        avail = online(profile, clock) if self.availability else jnp.ones_like(selected)
        late = jnp.zeros_like(selected)
        ok = selected & avail
        if self.deadline is not None:
            deadline = jnp.asarray(self.deadline, dtype)
            late = ok & (times > deadline)
            if self.late == "partial":
                fit = jnp.floor((deadline - comm) * profile.speed)
                fit = jnp.clip(fit, 0, steps).astype(num_steps.dtype)
                num_steps = jnp.where(late, fit, num_steps)
                times = jnp.where(
                    late, jnp.minimum(comm + fit.astype(dtype) / profile.speed, deadline), times
                )
                ok = ok & (~late | (fit >= 1))
            else:
                ok = ok & ~late
        u = jax.vmap(lambda i: jax.random.uniform(client_key(key, i), (), dtype))(ids)
        vanish = u < profile.dropout
        if self.availability:
            vanish = vanish | (times > online_left(profile, clock))
        dropped = ok & vanish
        ok = ok & ~vanish
        finish = jnp.where(ok, times, jnp.inf)
        if keep < ids.shape[0]:  # over-selection: the first `keep` to finish
            _, slots = jax.lax.top_k(-finish, keep)
        else:
            slots = jnp.arange(ids.shape[0])
        kept = ok[slots]
        finish = finish[slots]
        reported = jnp.sum(kept)
        target = jnp.minimum(keep, jnp.sum(selected & avail))  # offline: known at once
        slowest = jnp.max(jnp.where(kept, finish, 0.0))
        if self.deadline is not None:
            round_time = jnp.where(reported < target, deadline, slowest)
            round_time = jnp.where(reported == 0, deadline, round_time)
        else:
            round_time = jnp.where(reported == 0, jnp.asarray(self.idle, dtype), slowest)
        new_clock = clock + round_time
        metrics = {
            "round_time": round_time,
            "virtual_time": new_clock,
            "unavailable": jnp.sum(selected & ~avail),
            "late": jnp.sum(late),
            "dropouts": jnp.sum(dropped),
        }
        return Plan(
            slots=slots,
            weights=jnp.where(kept, weights[slots], 0.0),
            num_steps=num_steps[slots],
            times=finish,
            round_time=round_time,
            clock=new_clock,
            downloads=jnp.sum(selected & avail),
            metrics=metrics,
        )


# ------------------------------------------------------------------------------ asynchronous
def event_model(
    profiles: Profiles,
    num_clients: int,
    *,
    steps: int,
    bytes_down: float,
    bytes_up: float,
    aggregation: Aggregation | None = None,
    availability: bool = True,
    dt: float | None = None,
    max_probability: float = 0.1,
    capacity: int | Literal["auto"] | None = "auto",
    concurrency: int | None = None,
) -> Events:
    """The asynchronous event engine firing from the device model instead of fixed rates.

    Client i delivers at the Poisson rate `lambda_i = (1 - dropout_i) / time_i`, `time_i` its
    round time for `steps` local steps and the given per-client bytes (`client_times`; a
    vanished round is lost work, so deliveries are thinned by `1 - dropout_i`), discretised
    by `Arrivals.poisson(dt)` (time in seconds; `dt=None`: the largest with every firing
    probability <= `max_probability`; `aggregation`: default every 4 deliveries); with
    `availability`, arrivals outside a client's online window are lost
    (`Availability.periodic(period, session / period, phase)`).
    Deviation, documented: a client's work takes an exponential time of mean `time_i`
    (memoryless clocks, as the event engine's), not exactly `time_i`. The profiles of all C
    clients are drawn on the host once (the engine's own bookkeeping is `[C]` already).
    `concurrency` K: at most K clients train at any moment (`Events.concurrency`; None:
    every client trains all the time), so for identical clients the deliveries come at
    about K (1 - dropout) / time per second instead of C (1 - dropout) / time."""
    if not (isinstance(num_clients, int) and num_clients >= 1):
        raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}")
    check_number("steps", steps, lambda v: v >= 1 and v == int(v), "an integer >= 1")
    for name, value in (("bytes_down", bytes_down), ("bytes_up", bytes_up)):
        check_number(name, value, lambda v: 0 <= v < math.inf, "a finite number >= 0")
    p = Profile(*(np.asarray(v, np.float64) for v in profiles(jnp.arange(num_clients))))
    times = client_times(p, float(steps), float(bytes_down), float(bytes_up))
    arrivals = Arrivals.poisson((1.0 - p.dropout) / times, dt=dt, max_probability=max_probability)
    windows = None
    if availability:
        on = np.minimum(p.session / p.period, 1.0)
        windows = Availability.periodic(p.period, on, p.phase, num_clients=num_clients)
    aggregation = Aggregation() if aggregation is None else aggregation
    return Events(
        arrivals,
        aggregation,
        availability=windows,
        capacity=capacity,
        virtual_clock=True,
        concurrency=concurrency,
    )
