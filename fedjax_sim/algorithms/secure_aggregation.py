"""Secure aggregation as an aggregator wrapper: the server learns only the sum of the
survivors' quantised updates.

Bonawitz, Ivanov, Kreuter, Marcedone, McMahan, Patel, Ramage, Segal, Seth, "Practical Secure
Aggregation for Privacy-Preserving Machine Learning" (CCS 2017), honest-but-curious version;
Bell, Bonawitz, Gascon, Lepoint, Raykova, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead" (CCS 2020), SecAgg+ (masks and key shares only between graph
neighbours).

Round t, cohort of M slots at positions a = 0..M-1 (client ids `ids[a]`), field Z_{2^B}:

    client a:  x_a   <- inner.encode(Delta_a), L2-clipped to `clip`, + N(0, noise^2 I)
               q_a   <- SR(clamp(x_a, -R, R) L / R)  in [-L, L]            (integers)
               y_a   <- q_a + PRG(b_a) + sum_{b in N(a)} sign(a, b) PRG(s_ab)   mod 2^B
                        sign(a, b) = +1 if a < b else -1;  s_ab = s_ba
    dropout:   survivors U = {a : w_a > 0 and not dropped_a}   (after masking)
    server:    z = sum_{a in U} y_a - sum_{a in U} PRG(b_a)
                   - sum_{a in U, b in N(a) \\ U} sign(a, b) PRG(s_ab)        mod 2^B
             = sum_{a in U} q_a                                   (exactly, as integers)
               abort (update 0) unless |U| >= ceil(threshold M) (and, SecAgg+, every slot
               keeps >= ceil(threshold k) surviving neighbours to hold its key shares);
               total = signed(z) R / L,  weight = |U|  ->  inner.reduce

- Quantisation: L = min(floor((2^(B-1) - 1) / M), 2^24) so that the sum of M values in
  [-L, L] decodes uniquely from Z_{2^B} (and float32 holds every integer it rounds to).
  `rounding="stochastic"` (default): q = floor(y + u), u ~ U[0, 1) keyed per client
  (unbiased, |q/s - x| < R / L); "deterministic": round to nearest (|error| <= R / (2L)).
  Coordinates beyond the bound R are clamped (metric `secagg_clamped`).
- Masks: `jax.random.bits` (threefry) as the PRG; `s_ab` from the round key and the pair of
  client ids (symmetric), `b_a` from the round key and the client id; uint32 arithmetic wraps,
  so sums mod 2^32 are reduced mod 2^B by a bit mask. The graph N: the M - 1 others
  (`neighbours=M-1`, SecAgg) or a Harary graph over the cohort positions (`neighbours=k`,
  SecAgg+: the k/2 nearest positions on each side of a ring, plus the opposite one for odd
  k): cost O(M k d) per round, vectorised over the cohort (a `lax.scan` over the k offsets).
- Dropout: a client drops after masking with probability `dropout` (keyed per client), and
  every weight-0 slot of the round counts as dropped (a deadline's late clients, padding).
  The server recovers the dropped clients' pairwise masks from the survivors' shares
  (simulated: it regenerates them) and the survivors' self masks.
- Weights: secure aggregation sums each survivor once (weight |U|); cohort weights must be 0
  or 1 (`CohortSpec(weighting="uniform")`; metric `secagg_unit_weights`, as DP's).

Requirements and deviations (stated):
- A client's masks depend on the cohort, which `Aggregator.encode` does not see: `encode`
  runs the inner aggregator's encode, the clip and the noise (client side), and `reduce`
  simulates the rest of the clients' side (quantise, mask) vectorised over the stacked rows,
  then the server's. So the wrapper is `stacked=True` (`[M, d]` rows, like the robust
  aggregators) and `report_sent` reports the clipped float rows, not the masked integers.
- Honest-but-curious protocol (no signatures, no consistency check round); a slot's shares
  are counted as recoverable from its surviving neighbours (SecAgg+) or from the survivors.
- A failed round returns a zero update and keeps the inner aggregator's state (the server
  optimizer still steps with a zero pseudo-gradient).

Composition:
- DP: `secure_aggregation(dp_mean(z, C, m), neighbours=k, bound=C)` is central DP whose sum
  is computed securely (the server adds the noise). `distributed_dp(z, C, m, ...)` is the
  distributed-DP setting (Kairouz, Liu, Steinke, ICML 2021, with continuous Gaussian noise
  before stochastic rounding instead of their discrete Gaussian): each client adds
  N(0, (z C)^2 / t) with t = ceil(threshold m) the fewest survivors of a successful round,
  so the sum carries noise of std >= z C; the inner `dp_mean(0, C, m)` clips and divides by m.
- Compression: `secure_aggregation(compressed(Q), ...)`: each client sums Q(Delta_i) securely;
  the masked vector is dense (B bits per coordinate whatever Q sent), so sparsification saves
  no bytes. Put `secure_aggregation` outermost: an outer `compressed` would report its own
  payload.
- Refused (ValueError when building): an inner aggregator with `stacked=True` (median,
  trimmed mean, Krum, geometric median, centered clipping, another secure aggregation): they
  need the individual updates, which secure aggregation hides.

Payload (bytes one client sends, `payload_bytes`; X25519 keys, Shamir shares of 32-byte
secrets, AES-GCM):
    2 KEY_BYTES                                     (AdvertiseKeys: c_a^PK, s_a^PK)
  + k (2 ID_BYTES + 2 SHARE_BYTES + AEAD_BYTES)    (ShareKeys: shares of s_a^SK and b_a)
  + ceil(d B / 8)                                   (MaskedInputCollection)
  + k (ID_BYTES + SHARE_BYTES)                      (Unmasking: one share per neighbour)
with d the coordinates the inner aggregator sends, k the neighbours. Every participant is
counted for all four messages (clients that drop after masking send no Unmasking message:
an upper bound). The protocol costs `ROUND_TRIPS` = 4 server round trips instead of plain
FedAvg's one upload (metric `secagg_rounds`; `Aggregator.round_trips`: under a device model
the clock adds `DeviceModel.round_trip_latency` for each of the 3 extra ones).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.flatten_util import ravel_pytree

from fedjax_sim.algorithms.aggregators import Aggregator, mean
from fedjax_sim.algorithms.core import client_key, tree_norm
from fedjax_sim.algorithms.privacy import dp_mean
from fedjax_sim.core.checks import non_negative, positive
from fedjax_sim.core.rows import gather_rows

SECAGG = 0x7FFFFFFE  # folded into the uplink key for the protocol's draws (not a client id)
_QUANTISE, _PAIR, _SELF, _DROP, _NOISE = range(5)
KEY_BYTES = 32  # one X25519 public key
SHARE_BYTES = 32  # one Shamir share of a 32-byte secret
ID_BYTES = 4  # a client index
AEAD_BYTES = 28  # AES-GCM nonce (12) + tag (16)
ROUND_TRIPS = 4  # AdvertiseKeys, ShareKeys, MaskedInputCollection, Unmasking
EXACT_INT = 2**24  # float32 represents every integer up to this
ROUNDINGS = ("stochastic", "deterministic")


def payload_bytes(coordinates: int, bits: int, neighbours: int) -> int:
    """Bytes one client sends in a round of the protocol (module docstring)."""
    keys = 2 * KEY_BYTES
    shares = neighbours * (2 * ID_BYTES + 2 * SHARE_BYTES + AEAD_BYTES)
    unmasking = neighbours * (ID_BYTES + SHARE_BYTES)
    return keys + shares + math.ceil(coordinates * bits / 8) + unmasking


def levels(bits: int, slots: int) -> int:
    """L: each client's integers lie in [-L, L], so that the sum over `slots` clients decodes
    from Z_{2^bits}: L = min(floor((2^(bits-1) - 1) / slots), 2^24)."""
    n = min((2 ** (bits - 1) - 1) // slots, EXACT_INT)
    if n < 1:
        raise ValueError(f"secure aggregation: {bits} bits cannot hold the sum of {slots} clients")
    return n


def neighbour_offsets(slots: int, neighbours: int) -> tuple[int, ...]:
    """Position offsets o of the graph (a's neighbours are (a + o) mod M): all of 1..M-1 for
    k = M - 1 (SecAgg), else the Harary graph H_{k,M} (+-1..+-k/2, and M/2 for odd k)."""
    m, k = slots, neighbours
    if k > m - 1:
        raise ValueError(f"secure aggregation: {k} neighbours in a cohort of {m} (at most {m - 1})")
    if k == m - 1:
        return tuple(range(1, m))
    h = k // 2
    offsets = [*range(1, h + 1), *range(m - h, m)]
    if k % 2:
        if m % 2:
            raise ValueError(f"secure aggregation: odd neighbours {k} need an even cohort, not {m}")
        offsets.append(m // 2)
    return tuple(sorted(offsets))


def quantise(x, ids, key, bound, num_levels, stochastic=True):
    """`[M, d]` floats -> int32 `[M, d]` in [-L, L] at scale L / R (R = `bound`), rounded
    stochastically with client i's key `client_key(key, i)` or to the nearest integer."""
    y = jnp.clip(x.astype(jnp.float32), -bound, bound) * jnp.float32(num_levels / bound)
    if stochastic:
        u = jax.vmap(lambda i: jax.random.uniform(client_key(key, i), y.shape[1:]))(ids)
        q = jnp.floor(y + u)
    else:
        q = jnp.round(y)
    return jnp.clip(q, -num_levels, num_levels).astype(jnp.int32)


def _field_mask(bits: int) -> jax.Array:
    return jnp.uint32((1 << bits) - 1)


def to_field(q, bits: int):
    """int32 -> its residue in Z_{2^bits} (uint32)."""
    return lax.bitcast_convert_type(q.astype(jnp.int32), jnp.uint32) & _field_mask(bits)


def from_field(z, bits: int):
    """A residue in Z_{2^bits} (uint32) -> the signed integer in [-2^(bits-1), 2^(bits-1))."""
    shift = jnp.uint32(32 - bits)
    return lax.bitcast_convert_type(z << shift, jnp.int32) >> shift.astype(jnp.int32)


def _prg(key, d: int):
    return jax.random.bits(key, (d,), jnp.uint32)


def pairwise_masks(key, ids, offsets, d: int, keep=None):
    """`[M, d]` uint32: row a is `sum_{o} sign(a, b) PRG(s_ab)` over b = (a + o) mod M (where
    `keep[a, b]`, given as a function of the position arrays), s_ab from the pair of ids."""
    m = ids.shape[0]
    pos = jnp.arange(m)

    def body(acc, o):
        b = (pos + o) % m
        lo, hi = jnp.minimum(ids, ids[b]), jnp.maximum(ids, ids[b])
        masks = jax.vmap(lambda i, j: _prg(client_key(client_key(key, i), j), d))(lo, hi)
        masks = jnp.where((pos < b)[:, None], masks, jnp.uint32(0) - masks)
        if keep is not None:
            masks = jnp.where(keep(pos, b)[:, None], masks, jnp.uint32(0))
        return acc + masks, None

    acc, _ = lax.scan(body, jnp.zeros((m, d), jnp.uint32), jnp.asarray(offsets, jnp.int32))
    return acc


def self_masks(key, ids, d: int):
    """`[M, d]` uint32: PRG(b_a), b_a from client a's id."""
    return jax.vmap(lambda i: _prg(client_key(key, i), d))(ids)


def mask(q, ids, key, offsets, bits: int):
    """The clients' side: `y_a = q_a + PRG(b_a) + sum_b sign(a, b) PRG(s_ab) mod 2^bits` for
    the int32 `q [M, d]`; returns uint32 `[M, d]`."""
    d = q.shape[1]
    y = to_field(q, bits) + self_masks(jax.random.fold_in(key, _SELF), ids, d)
    y = y + pairwise_masks(jax.random.fold_in(key, _PAIR), ids, offsets, d)
    return y & _field_mask(bits)


def unmask(masked, alive, ids, key, offsets, bits: int):
    """The server's side: from the masked `[M, d]` (only the `alive [M]` rows are received)
    to `sum_{alive} q_a mod 2^bits` (uint32 `[d]`), removing the survivors' self masks and
    the pairwise masks they shared with dropped clients."""
    d = masked.shape[1]
    zero = jnp.uint32(0)
    received = jnp.sum(jnp.where(alive[:, None], masked, zero), axis=0, dtype=jnp.uint32)
    selfs = self_masks(jax.random.fold_in(key, _SELF), ids, d)
    own = jnp.sum(jnp.where(alive[:, None], selfs, zero), axis=0, dtype=jnp.uint32)
    recovered = pairwise_masks(
        jax.random.fold_in(key, _PAIR), ids, offsets, d, keep=lambda a, b: alive[a] & ~alive[b]
    )
    lost = jnp.sum(recovered, axis=0, dtype=jnp.uint32)
    return (received - own - lost) & _field_mask(bits)


def survived(ids, weights, key, dropout):
    """`[M]` bool: weight > 0 and not dropped (probability `dropout`, keyed per client)."""
    k = jax.random.fold_in(key, _DROP)
    dropped = jax.vmap(lambda i: jax.random.bernoulli(client_key(k, i), dropout))(ids)
    return (weights > 0) & ~dropped


def recoverable(alive, offsets, threshold: float, complete: bool):
    """Whether the server can unmask: >= ceil(threshold M) survivors and (SecAgg+) every slot
    keeps >= ceil(threshold k) surviving neighbours holding its key shares."""
    m = alive.shape[0]
    ok = jnp.sum(alive) >= math.ceil(threshold * m)
    if not complete and offsets:
        pos = jnp.arange(m)
        near = sum(alive[(pos + o) % m].astype(jnp.int32) for o in offsets)
        ok = ok & jnp.all(near >= math.ceil(threshold * len(offsets)))
    return ok


def secure_aggregation(
    inner: Aggregator | None = None,
    *,
    neighbours: int,
    bits: int = 32,
    clip: float | None = None,
    bound: float | None = None,
    threshold: float = 0.5,
    dropout: float = 0.0,
    rounding: str = "stochastic",
    noise: float = 0.0,
) -> Aggregator:
    """Secure aggregation (SecAgg, SecAgg+) around `inner` (mean); see the module docstring.

    Args:
      inner: what the decoded sum is reduced by (mean, DP's `dp_mean`, `compressed`, ...);
        not one that needs individual updates (`stacked=True`).
      neighbours: k, each client's mask and key-share neighbours: the cohort size M - 1 is
        SecAgg's complete graph, fewer is SecAgg+ (Bell et al.: O(log M)).
      bits: B, the field Z_{2^B} (2..32; 32: uint32 arithmetic wraps by itself).
      clip: L2 clip norm of each client's vector (None: the inner aggregator's own).
      bound: R, the quantisation range [-R, R] per coordinate (default `clip`).
      threshold: the round aborts unless >= ceil(threshold M) clients survive.
      dropout: probability that a client drops after masking.
      rounding: "stochastic" (unbiased) or "deterministic" (nearest).
      noise: std of the Gaussian each client adds before quantising (distributed DP).

    Metrics: `secagg_survivors`, `secagg_failed` (1: aborted, update 0), `secagg_rounds`,
    `secagg_clamped` (fraction of the survivors' coordinates clamped to R),
    `secagg_unit_weights`, and the inner aggregator's.
    """
    inner = inner or mean()
    if inner.stacked:
        raise ValueError(
            "secure aggregation reveals only the sum: it cannot wrap an aggregator that needs "
            "the individual updates (median, trimmed mean, Krum, ...)"
        )
    if not isinstance(neighbours, int) or neighbours < 0:
        raise ValueError(f"secure aggregation: neighbours must be an int >= 0, got {neighbours!r}")
    if not isinstance(bits, int) or not 2 <= bits <= 32:
        raise ValueError(f"secure aggregation: bits must be an int in [2, 32], got {bits!r}")
    if clip is not None:
        positive("secure aggregation clip", clip)
    bound = clip if bound is None else bound
    if bound is None:
        raise ValueError("secure aggregation needs a quantisation range: give clip or bound")
    positive("secure aggregation bound", bound)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"secure aggregation: threshold must be in [0, 1], got {threshold!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"secure aggregation: dropout must be in [0, 1), got {dropout!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"secure aggregation: rounding must be one of {ROUNDINGS}, got {rounding!r}"
        )
    non_negative("secure aggregation noise", noise)

    def encode(update, rows, key, server):
        sent, rows = inner.encode(update, rows, jax.random.fold_in(key, 1), server)
        if clip is not None:
            norm = tree_norm(sent)
            scale = jnp.minimum(1.0, clip / jnp.maximum(norm, jnp.finfo(norm.dtype).tiny))
            sent = jax.tree.map(lambda x: (x * scale).astype(x.dtype), sent)
        if noise:
            leaves, treedef = jax.tree.flatten(sent)
            keys = jax.random.split(jax.random.fold_in(key, 2), len(leaves))
            sent = jax.tree.unflatten(
                treedef,
                [
                    (x + noise * jax.random.normal(k, jnp.shape(x), jnp.float32)).astype(x.dtype)
                    for x, k in zip(leaves, keys, strict=True)
                ],
            )
        return sent, rows

    def reduce(server, total, weight, stacked, cohort, key):
        del total, weight  # the float sum compose fused: the server never sees it
        key = jax.random.fold_in(key, SECAGG)
        rows = jax.vmap(lambda r: ravel_pytree(r)[0])(stacked)  # [M, d]
        unravel = ravel_pytree(jax.tree.map(lambda x: x[0], stacked))[1]
        m = rows.shape[0]
        num_levels = levels(bits, m)
        offsets = neighbour_offsets(m, neighbours)
        ids = cohort.ids
        q = quantise(
            rows,
            ids,
            jax.random.fold_in(key, _QUANTISE),
            bound,
            num_levels,
            rounding == "stochastic",
        )
        masked = mask(q, ids, key, offsets, bits)
        alive = survived(ids, cohort.weights, key, dropout)
        ok = recoverable(alive, offsets, threshold, neighbours == m - 1)
        z = from_field(unmask(masked, alive, ids, key, offsets, bits), bits)
        total = unravel(z.astype(jnp.float32) * jnp.float32(bound / num_levels))
        n = jnp.sum(alive)
        weights = alive.astype(cohort.weights.dtype)
        update, new_server, metrics = inner.reduce(
            server,
            total,
            n.astype(cohort.weights.dtype),
            None,
            cohort._replace(weights=weights),
            key,
        )
        update = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), update)
        new_server = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_server, server)
        clamped = jnp.sum(jnp.where(alive[:, None], jnp.abs(rows) > bound, False))
        unit = jnp.all((cohort.weights == 0) | (cohort.weights == 1))
        metrics = {
            **metrics,
            "secagg_survivors": n,
            "secagg_failed": 1.0 - ok.astype(jnp.float32),
            "secagg_rounds": jnp.float32(ROUND_TRIPS),
            "secagg_clamped": clamped / jnp.maximum(n * rows.shape[1], 1),
            "secagg_unit_weights": unit.astype(jnp.float32),
        }
        return update, new_server, metrics

    def payload(params):
        return float(payload_bytes(_coordinates(inner, params), bits, neighbours))

    return Aggregator(
        init=inner.init,
        encode=encode,
        reduce=reduce,
        payload=payload,
        stacked=True,
        round_trips=ROUND_TRIPS,
        private=inner.private,
    )


def _coordinates(inner: Aggregator, params: Any) -> int:
    """Coordinates one client sends through `inner` (from shapes: `jax.eval_shape`)."""

    def sent(p):
        server, rows = inner.init(p, 1)
        row = jax.tree.map(lambda r: r[0], gather_rows(rows, jnp.zeros((1,), jnp.int32)))
        return inner.encode(p, row, jax.random.PRNGKey(0), server)[0]

    shapes = jax.eval_shape(sent, params)
    return int(sum(math.prod(s.shape) for s in jax.tree.leaves(shapes)))


def distributed_dp(
    noise_multiplier: float,
    clip_norm: float,
    expected_cohort: float,
    *,
    neighbours: int,
    threshold: float = 0.5,
    bits: int = 32,
    dropout: float = 0.0,
    bound: float | None = None,
) -> Aggregator:
    """Distributed DP (module docstring): each client clips to C (`dp_mean(0, C, m)`, which
    also divides by m) and adds N(0, sigma^2), sigma = z C / sqrt(ceil(threshold m)), before
    secure aggregation; range R = C + 4 sigma unless `bound` is given."""
    positive("expected cohort size", expected_cohort)
    sigma = distributed_noise_std(noise_multiplier, clip_norm, expected_cohort, threshold)
    return secure_aggregation(
        dp_mean(0.0, clip_norm, expected_cohort),
        neighbours=neighbours,
        bits=bits,
        bound=clip_norm + 4.0 * sigma if bound is None else bound,
        threshold=threshold,
        dropout=dropout,
        noise=sigma,
    )


def distributed_noise_std(
    noise_multiplier: float, clip_norm: float, expected_cohort: float, threshold: float
) -> float:
    """Each client's noise std z C / sqrt(t), t = max(1, ceil(threshold m)): a successful
    round sums >= t clients' noise, std >= z C (the central mechanism's)."""
    non_negative("noise multiplier", noise_multiplier)
    positive("clip norm", clip_norm)
    t = max(1, math.ceil(threshold * expected_cohort))
    return noise_multiplier * clip_norm / math.sqrt(t)


__all__ = [
    "ROUND_TRIPS",
    "distributed_dp",
    "distributed_noise_std",
    "from_field",
    "levels",
    "mask",
    "neighbour_offsets",
    "payload_bytes",
    "quantise",
    "recoverable",
    "secure_aggregation",
    "survived",
    "to_field",
    "unmask",
]
