"""Buffered asynchronous FedAvg family: AS-FedAvg, FedBuff and FedAsync, as presets of
`asynchronous.compose_async`.

- AS-FedAvg (asynchronous FedAvg / asynchronous SGD, e.g. Koloskova et al. 2022): deltas are
  summed in a buffer and applied at aggregation, x_s <- x_s + eta_g * buf; no staleness
  weighting. buffer_size = 1 applies every update on arrival.
- FedBuff (Nguyen et al., AISTATS 2022): buf += s(tau_i) Delta_i; at aggregation
  x_s <- x_s + eta_g * buf / cnt, cnt = number of buffered deliveries (= buffer_size in
  categorical mode). s(tau) = 1/sqrt(1 + tau) by default; constant, polynomial (1+tau)^-a
  and hinge too.
- FedAsync (Xie et al. 2019): each arrival is mixed in at once,
  x_s <- (1 - beta s(tau)) x_s + beta s(tau) x_i (needs aggregation every delivery).

Spec: `docs/specs/area_async.md` Section 2.5 (standard definitions, not from the AREA
paper) in the pending-computation event model: client i holds r_i, the server model it last
read, and delivers Delta_i = x_i - r_i with x_i = LU_i(r_i) (K local steps); tau_i is the
staleness of the delivered work in server versions. `server_optimizer` is eta_g (1 in the
spec).

Deviations, documented: FedAsync's optional proximal term in local training is not included
(plain local SGD, as the spec defines it; `compose_async` with `hooks.proximal(mu)` adds it);
in bernoulli mode several arrivals of one iteration are mixed in sequentially in client-id
order and share the version they were measured against.
"""

from __future__ import annotations

from fedjax_sim.algorithms.asynchronous import (
    AsyncOptions,
    Staleness,
    async_preset,
    asynchronous,
    buffered,
    mixed,
    staleness_weight,
)
from fedjax_sim.algorithms.core import Algorithm, LossFn


@async_preset()
def as_fedavg(loss_fn: LossFn, *, options: AsyncOptions) -> Algorithm:
    """AS-FedAvg: asynchronous FedAvg, x_s <- x_s + eta_g * sum of buffered deltas."""
    rule = buffered(staleness_weight("constant"), options.server_optimizer, mean=False)
    return asynchronous(loss_fn, options, rule)


@async_preset()
def fedbuff(
    loss_fn: LossFn,
    *,
    staleness: Staleness = "sqrt",
    staleness_a: float = 0.5,
    staleness_b: float = 4.0,
    options: AsyncOptions,
) -> Algorithm:
    """FedBuff: staleness-weighted buffer, x_s <- x_s + eta_g * buf / (buffered deliveries).

    `staleness`: "sqrt" 1/sqrt(1+tau) (default), "constant", "polynomial" (1+tau)^-a,
    "hinge" (1 up to b, then 1/(a(tau-b)+1)); `staleness_a`/`staleness_b` are a and b."""
    weight = staleness_weight(staleness, staleness_a, staleness_b)
    return asynchronous(loss_fn, options, buffered(weight, options.server_optimizer, mean=True))


@async_preset(fixed=("buffer_size", "server_optimizer"), buffer_size=1, read_after_aggregate=True)
def fedasync(
    loss_fn: LossFn,
    *,
    mixing: float = 0.5,
    staleness: Staleness = "polynomial",
    staleness_a: float = 0.5,
    staleness_b: float = 4.0,
    options: AsyncOptions,
) -> Algorithm:
    """FedAsync: x_s <- (1 - beta s(tau)) x_s + beta s(tau) x_i at every arrival.

    `mixing` is beta; `staleness` as for `fedbuff` (default polynomial with a = 0.5). The events
    model must aggregate every delivery (`Aggregation.every(1)`, the default here). By default
    the client then reads the mixed model (Xie et al.'s scheduler hands out the latest model)."""
    weight = staleness_weight(staleness, staleness_a, staleness_b)
    return asynchronous(loss_fn, options, mixed(mixing, weight))
