"""Which parameters train and which travel: a label per parameter leaf (optax's
`multi_transform` labels).

| label | trains on the client | travels (update, aggregator, server optimizer) | lives |
|---|---|---|---|
| `"shared"` | yes | yes | in the global model |
| `"personal"` | yes | never | a per-client row `[C, ...]` (`Rows`, streams and shards) |
| `"frozen"` | no (no gradient is computed) | never | once, in the global model |

FedPer's personal head, LG-FedAvg's personal body, FedBABU's frozen head and LoRA's frozen base
with shared adapters are partitions. A round with a partition (`ClientWork(partition=...)`):

    start_i  = merge(shared(x_t), personal row i, frozen(x_t))
    local training of trainable(start_i) (shared + personal leaves) on loss(merge(., frozen))
    personal row i <- personal(x_i)            (never sent)
    client sends shared(update_i)              (payload: the shared leaves only)
    x_{t+1} = merge(server step on shared(x_t), personal(x_t), frozen(x_t))

The server's personal leaves stay the initial ones (the template new clients start from: no
client's personal values ever reach the server state); frozen leaves never change on the clients,
and on the server only where a hook's `finalize` returns them (it sees them in
`RoundSummary.model`: FLoRA merges the aggregated adapters into the frozen base,
`algorithms.lora.flora`). Views are
trees of the params' structure holding `optax.MaskedNode()` at the leaves they leave out, so
every tree operation, aggregator and optax transformation applies to them unchanged and their
bytes count only the leaves they hold.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Literal

import jax
import optax

Params = Any
Label = Literal["shared", "personal", "frozen"]
LABELS = ("shared", "personal", "frozen")
TRAINABLE = ("shared", "personal")
PERSONAL_ROWS = "personal"  # key of the personal rows in `FederatedState.rows`


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def path_name(path: tuple) -> str:
    """`"params/Dense_0/kernel"` of a pytree key path."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


@dataclasses.dataclass(frozen=True)
class Partition:
    """A label (`"shared"`, `"personal"`, `"frozen"`) per parameter leaf.

    Attributes:
      labels: a pytree of labels of the params' structure, or `params -> labels` (see
        `by_path`).
    """

    labels: Any

    def of(self, params: Params) -> Any:
        """The labels tree of `params` (checked: the params' structure, known labels)."""
        labels = self.labels(params) if callable(self.labels) else self.labels
        structure = jax.tree.structure(params)
        try:
            flat = structure.flatten_up_to(labels)
        except (ValueError, TypeError) as e:
            raise ValueError(f"partition labels do not match the params' structure: {e}") from e
        bad = sorted({str(v) for v in flat if v not in LABELS})
        if bad:
            raise ValueError(f"partition labels must be one of {LABELS}, got {bad}")
        if "shared" not in flat and "personal" not in flat:
            raise ValueError("a partition needs a trainable leaf (shared or personal)")
        return structure.unflatten(flat)

    def has(self, params: Params, label: Label) -> bool:
        """Whether some leaf of `params` has `label`."""
        return label in jax.tree.leaves(self.of(params))

    def select(self, tree: Params, params: Params, *labels: Label) -> Params:
        """`tree` (of the params' structure, e.g. an update; views too) with
        `optax.MaskedNode()` at the leaves whose label is not in `labels`."""
        structure = jax.tree.structure(params)
        flat_labels = structure.flatten_up_to(self.of(params))
        flat = structure.flatten_up_to(tree)
        masked = optax.MaskedNode()
        return structure.unflatten(
            [v if lab in labels else masked for v, lab in zip(flat, flat_labels, strict=True)]
        )

    def merge(self, params: Params, *views: Params) -> Params:
        """The full tree: each leaf from the first of `views` that holds it (not a
        `MaskedNode`); views are trees of the params' structure."""
        structure = jax.tree.structure(params)
        flats = [structure.flatten_up_to(v) for v in views]
        out = []
        for leaves in zip(*flats, strict=True):
            held = [v for v in leaves if not _is_masked(v)]
            if not held:
                raise ValueError("partition.merge: a leaf is held by none of the views")
            out.append(held[0])
        return structure.unflatten(out)

    def fill(self, view: Params, like: Params, params: Params, value: Callable) -> Params:
        """`view` with its `MaskedNode` leaves replaced by `value(leaf of like)` (e.g. the
        zeros of the personal leaves of an update the hooks see)."""
        structure = jax.tree.structure(params)
        flat_view, flat_like = structure.flatten_up_to(view), structure.flatten_up_to(like)
        return structure.unflatten(
            [
                value(b) if _is_masked(a) and not _is_masked(b) else a
                for a, b in zip(flat_view, flat_like, strict=True)
            ]
        )


def by_path(*, personal: str | None = None, frozen: str | None = None) -> Partition:
    """Labels by regular expressions on the leaves' paths (`"params/Dense_2/kernel"`,
    `re.search`): `personal` and `frozen` leaves (a path matching both is refused); every
    other leaf is shared. E.g. FedPer's personal head `by_path(personal="Dense_2")`."""
    patterns = {k: re.compile(v) for k, v in (("personal", personal), ("frozen", frozen)) if v}

    def labels(params: Params) -> Any:
        def label(path, _):
            name = path_name(path)
            hits = [k for k, p in patterns.items() if p.search(name)]
            if len(hits) > 1:
                raise ValueError(f"parameter {name!r} matches both personal and frozen")
            return hits[0] if hits else "shared"

        out = jax.tree_util.tree_map_with_path(label, params)
        for k, p in patterns.items():
            if k not in jax.tree.leaves(out):
                names = [path_name(q) for q, _ in jax.tree_util.tree_leaves_with_path(params)]
                raise ValueError(f"{k}={p.pattern!r} matches no parameter; paths are {names}")
        return out

    return Partition(labels)
