"""Byzantine clients: every synchronous preset takes `attack=Attack(...)` (a
`compose.Options` field), which `compose.synchronous` turns into the `byzantine(attack)` hook
(last in the chain: what a Byzantine client trains on and sends) or, for ALIE, the
`colluding(attack, inner)` aggregator (what the colluding clients send, from the cohort's
updates).

Who is Byzantine: the fixed `ids`, or `round(fraction C)` clients drawn once from `seed`
(`sampling="fixed"`), or each cohort client independently with probability `fraction` in
each round (`sampling="round"`). What they do:

- `sign_flip`: send `-scale Delta_i` (Damaskinos et al. 2018; Allen-Zhu et al. 2021).
- `scale`: model replacement, send `scale Delta_i` (Bagdasaryan et al., "How To Backdoor
  Federated Learning", AISTATS 2020; boost factor `scale`).
- `gaussian`: send `N(0, scale^2 I)` (Blanchard et al. 2017's Gaussian Byzantine workers).
- `alie`: "a little is enough" (Baruch, Baruch, Goldberg, NeurIPS 2019): every Byzantine
  cohort client sends `mu - z sigma` (coordinate-wise mean and std of the Byzantine clients'
  own honest updates, as in the paper's non-omniscient setting; `z = scale`, default 1.0,
  where the paper derives z from n and f). This needs
  the cohort's updates: the `colluding` aggregator stacks the sent updates and replaces the
  Byzantine rows (after the inner aggregator's `encode`; per-client aggregator memories are
  not affected).
- `label_flip`: data poisoning, labels y -> num_classes - 1 - y on the Byzantine clients'
  data (Tolpegin et al., "Data Poisoning Attacks Against Federated Learning Systems",
  ESORICS 2020); they then train honestly.

Honest clients are untouched (tested: exactly the chosen clients change).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.aggregators import Aggregator, mean
from fedjax_sim.algorithms.local_hook import LocalHook
from fedjax_sim.core.checks import check_number

KINDS = ("sign_flip", "scale", "gaussian", "alie", "label_flip")
ATTACK_NOISE = 0x5A77AC  # folded into the client's key for the Gaussian attack
# allowed `scale` per kind: a factor sent with the update's sign flipped / kept, a std, a z
SCALE_RANGE = {
    "sign_flip": (lambda v: 0 < v < float("inf"), "a finite number > 0"),
    "scale": (lambda v: 0 < v < float("inf"), "a finite number > 0"),
    "gaussian": (lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    "alie": (lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
}


@dataclasses.dataclass(frozen=True)
class Attack:
    """A Byzantine attack (see the module docstring).

    Attributes:
      kind: sign_flip | scale | gaussian | alie | label_flip.
      fraction: fraction of Byzantine clients (ignored when `ids` is given).
      ids: fixed Byzantine client ids.
      sampling: "fixed" (one set for the run, from `seed`) or "round" (drawn per round).
      scale: sign_flip's / scale's factor, gaussian's std, ALIE's z (None: 1; scale: 10).
      num_classes: classes of the labels (label_flip).
      seed: seed of the fixed Byzantine set / of per-round draws.
    """

    kind: str
    fraction: float = 0.1
    ids: tuple[int, ...] | None = None
    sampling: str = "fixed"
    scale: float | None = None
    num_classes: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"attack must be one of {'|'.join(KINDS)}, got {self.kind!r}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"byzantine fraction must be in [0, 1], got {self.fraction}")
        if self.sampling not in ("fixed", "round"):
            raise ValueError(f"attack sampling must be fixed|round, got {self.sampling!r}")
        if self.scale is not None:
            if self.kind not in SCALE_RANGE:
                raise ValueError(f"{self.kind} attack takes no scale, got {self.scale!r}")
            ok, requirement = SCALE_RANGE[self.kind]
            check_number(f"{self.kind} attack scale", self.scale, ok, requirement)
        if self.kind == "label_flip" and not (self.num_classes and self.num_classes >= 2):
            raise ValueError("label_flip needs num_classes >= 2")
        if self.ids is not None:
            object.__setattr__(self, "ids", tuple(int(i) for i in self.ids))

    @property
    def factor(self) -> float:
        if self.scale is not None:
            return float(self.scale)
        return 10.0 if self.kind == "scale" else 1.0

    def byzantine_set(self, num_clients: int) -> jax.Array:
        """`[C]` bool: the fixed Byzantine clients."""
        if self.ids is not None:
            return jnp.zeros(num_clients, bool).at[jnp.asarray(self.ids, jnp.int32)].set(True)
        count = int(round(self.fraction * num_clients))
        perm = jax.random.permutation(jax.random.key(self.seed), num_clients)
        return jnp.zeros(num_clients, bool).at[perm[:count]].set(True)

    def is_byzantine(self, client: jax.Array, round_: jax.Array, num_clients: int) -> jax.Array:
        """[] bool for one client in round `round_`."""
        if self.sampling == "round" and self.ids is None:
            k = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), round_), client)
            return jax.random.uniform(k) < self.fraction
        return self.byzantine_set(num_clients)[client]

    def poison_batch(self, batch: Any, byzantine: jax.Array) -> Any:
        """Label flipping of a minibatch (other kinds: unchanged)."""
        if self.kind != "label_flip":
            return batch
        y = jnp.where(byzantine, self.num_classes - 1 - batch.y, batch.y).astype(batch.y.dtype)
        return batch._replace(y=y)

    def poison_update(self, update: Any, byzantine: jax.Array, key: jax.Array) -> Any:
        """The update a client sends (sign_flip / scale / gaussian; others unchanged)."""
        s = self.factor
        if self.kind == "sign_flip":
            bad = jax.tree.map(lambda u: -s * u, update)
        elif self.kind == "scale":
            bad = jax.tree.map(lambda u: s * u, update)
        elif self.kind == "gaussian":
            leaves, treedef = jax.tree.flatten(update)
            keys = jax.random.split(jax.random.fold_in(key, ATTACK_NOISE), len(leaves))
            bad = jax.tree.unflatten(
                treedef,
                [
                    (s * jax.random.normal(k, u.shape, jnp.float32)).astype(u.dtype)
                    for u, k in zip(leaves, keys, strict=True)
                ],
            )
        else:
            return update
        return jax.tree.map(lambda b, u: jnp.where(byzantine, b, u).astype(u.dtype), bad, update)

    @property
    def cohort_level(self) -> bool:
        return self.kind == "alie"

    def poison_cohort(self, stacked: Any, byzantine: jax.Array, weights: jax.Array) -> Any:
        """ALIE on the stacked sent updates `[M, ...]`: the Byzantine participants' rows become
        `mu - z sigma` (mean and std over the Byzantine participants' own updates)."""
        b = (byzantine & (weights > 0)).astype(jnp.float32)
        n = jnp.maximum(jnp.sum(b), 1.0)
        z = self.factor

        def leaf(x):
            xf = x.astype(jnp.float32)
            mu = jnp.tensordot(b, xf, axes=1) / n
            var = jnp.tensordot(b, jnp.square(xf - mu[None]), axes=1) / n
            bad = mu - z * jnp.sqrt(var)
            mask = b.reshape(-1, *([1] * (x.ndim - 1))) > 0
            return jnp.where(mask, bad[None], xf).astype(x.dtype)

        return jax.tree.map(leaf, stacked)


def byzantine(attack: Attack) -> LocalHook:
    """The Byzantine clients of `attack` (all kinds but ALIE) as a local-step hook, last in
    the chain. Its client input is the round's Byzantine flags `[M]` (the adversary's own
    knowledge, not sent); a Byzantine client trains on flipped labels (`label_flip`: every
    loss of the chain sees the poisoned minibatch) or sends a poisoned update (`sign_flip`,
    `scale`, `gaussian`, in its `finish`, after the other hooks')."""
    if attack.cohort_level:
        raise ValueError("ALIE needs the cohort's updates: use colluding(attack, inner)")

    def prepare(server, cohort, params, key):
        flag = lambda c: attack.is_byzantine(c, cohort.round, cohort.num_clients)
        return server, jax.vmap(flag)(cohort.ids)

    def direction(value_and_grad, params, batch, carry, ctx):
        loss, grads = value_and_grad(params, attack.poison_batch(batch, ctx.client_input))
        return loss, grads, carry

    def finish(ctx, outcome):
        update = attack.poison_update(outcome.update, ctx.client_input, ctx.key)
        return ctx.row, None, None, update

    return LocalHook(
        "byzantine",
        direction,
        prepare=prepare,
        finish=finish,
        not_sent=("client_input",),
    )


def colluding(attack: Attack, inner: Aggregator | None = None) -> Aggregator:
    """ALIE's colluding Byzantine clients around `inner` (default `mean()`): the sent updates
    are stacked `[M, ...]` (after `inner`'s encode) and the Byzantine participants' rows
    replaced by `mu - z sigma` (`Attack.poison_cohort`) before `inner`'s reduce."""
    if not attack.cohort_level:
        raise ValueError(f"{attack.kind} is a client's own attack: use the byzantine(attack) hook")
    inner = inner or mean()

    def reduce(server, total, weight, stacked, cohort, key):
        flag = lambda c: attack.is_byzantine(c, cohort.round, cohort.num_clients)
        stacked = attack.poison_cohort(stacked, jax.vmap(flag)(cohort.ids), cohort.weights)
        total = jax.tree.map(
            lambda x: jnp.tensordot(cohort.weights.astype(x.dtype), x, axes=1), stacked
        )
        return inner.reduce(server, total, weight, stacked if inner.stacked else None, cohort, key)

    return inner._replace(reduce=reduce, stacked=True)
