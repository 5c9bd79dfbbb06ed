"""Personalized presets that split the model into a body and a head (`partition.Partition`):
FedPer, LG-FedAvg, FedRep and FedBABU. Personal parts are per-client rows `[C, ...]` (they
stream from the host and shard like every row); only the shared part is sent, aggregated and
stepped by the server optimizer; `Algorithm.personalize` gives each client's model (the
global shared part with its own personal part; FedBABU's: fine-tuned).

| preset | shared (travels) | personal (a row) | local steps | paper |
|---|---|---|---|---|
| `fedper` | body | head | all trainable leaves together | Arivazhagan et al. 2019 |
| `lg_fedavg` | head | body | all trainable leaves together | Liang et al. 2020 |
| `fedrep` | body | head | `head_steps` on the head, then the body | Collins et al., ICML 2021 |
| `fedbabu` | body | - (head frozen at init) | the body only | Oh, Kim, Yun, ICLR 2022 |

The head is the model's last layer (the last top-level module in natural order, e.g.
`Dense_2` of an MLP, below a single wrapper such as flax's `params`), or the leaves whose
path (`"Dense_2/kernel"`) matches the regular expression `head`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, LossFn
from fedjax_sim.algorithms.local_hook import LocalHook
from fedjax_sim.algorithms.partition import Label, Partition, path_name
from fedjax_sim.algorithms.personal_models import check_finetune, fine_tuned
from fedjax_sim.core.checks import check_number

Params = Any


def _natural(name: Any) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(name))]


def head_of(head: str | None) -> Any:
    """`tree -> (path -> bool)`: whether a leaf's key path is in the head (see the module
    docstring); raises ValueError when the model has no separate last layer or `head`
    matches no leaf."""

    def is_head_fn(tree: Params):
        names = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
        if head is not None:
            pattern = re.compile(head)
            if not any(pattern.search(n) for n in names):
                raise ValueError(f"head={head!r} matches no parameter; paths are {names}")
            return lambda path: bool(pattern.search(path_name(path)))
        node, prefix = tree, ()
        while isinstance(node, Mapping) and len(node) == 1:
            (k,) = node
            node, prefix = node[k], (*prefix, str(k))
        if not isinstance(node, Mapping) or len(node) < 2:
            raise ValueError(
                f"cannot tell the model's last layer from its parameters {names}: pass head= "
                "(a regular expression on these paths)"
            )
        last = (*prefix, str(max(node, key=_natural)))
        return lambda path: tuple(path_name(path).split("/")[: len(last)]) == last

    return is_head_fn


def head_and_body(head: str | None, *, head_label: Label, body_label: Label) -> Partition:
    """The partition labelling the head (`head_of(head)`) and every other leaf."""
    find = head_of(head)

    def labels(params: Params) -> Any:
        is_head = find(params)
        return jax.tree_util.tree_map_with_path(
            lambda path, _: head_label if is_head(path) else body_label, params
        )

    return Partition(labels)


def _with_partition(options: Options, partition: Partition) -> Options:
    if options.partition is not None:
        raise ValueError("this preset sets the partition itself; choose the head with head=")
    return dataclasses.replace(options, partition=partition)


@preset()
def fedper(loss_fn: LossFn, *, head: str | None = None, options: Options) -> Algorithm:
    """FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", 2019):
    FedAvg on the body; each client keeps its own head (a row), trained with the body in
    every local step and never sent. Client i's model is (x_t's body, its head)."""
    partition = head_and_body(head, head_label="personal", body_label="shared")
    return synchronous(loss_fn, _with_partition(options, partition))


@preset()
def lg_fedavg(loss_fn: LossFn, *, head: str | None = None, options: Options) -> Algorithm:
    """LG-FedAvg (Liang et al., "Think Locally, Act Globally", 2020): each client keeps its
    own local representation (the body, a row); FedAvg on the global head."""
    partition = head_and_body(head, head_label="shared", body_label="personal")
    return synchronous(loss_fn, _with_partition(options, partition))


def alternating(head_steps: int, head: str | None = None) -> LocalHook:
    """FedRep's local schedule (Collins et al. 2021, Algorithm 1): local steps
    `k < head_steps` move the head only (the body's direction is 0), later steps the body
    only. Carry: the step counter (steps past a client's `num_steps` do not count)."""
    check_number("FedRep head_steps", head_steps, lambda v: v >= 0 and v == int(v), "an int >= 0")
    find = head_of(head)

    def direction(value_and_grad, params, batch, step, ctx):
        loss, grads = value_and_grad(params, batch)
        is_head = find(grads)
        on_head = step < head_steps
        grads = jax.tree_util.tree_map_with_path(
            lambda path, g: jnp.where(on_head == is_head(path), g, jnp.zeros_like(g)), grads
        )
        return loss, grads, step + 1

    return LocalHook("alternating", direction, start=lambda ctx: jnp.int32(0))


@preset()
def fedrep(
    loss_fn: LossFn, *, head_steps: int | None = None, head: str | None = None, options: Options
) -> Algorithm:
    """FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
    Learning", ICML 2021): each client keeps its head (a row); a round's local steps first
    fit the head for `head_steps` steps with the body fixed at x_t's, then move the body with
    the head fixed (`alternating`); the server averages the bodies. With
    `local=LocalSpec(steps=K)` the body gets `K - head_steps` steps; `head_steps` must leave
    it one. None: the paper's ratio (tau_h = 10 head epochs, 1 body epoch), the body's share
    `ceil(K / 11)` of the K steps (K = 10: 9 head steps and 1 body step); give `head_steps`
    with `LocalSpec(epochs=...)`."""
    steps = options.local.steps
    if head_steps is None:
        if options.local.epochs is not None or steps is None:
            raise ValueError("FedRep with local epochs: give head_steps (local steps on the head)")
        head_steps = steps - math.ceil(steps / 11)
    if options.local.epochs is None and steps is not None and head_steps >= steps:
        raise ValueError(
            f"FedRep head_steps={head_steps} leaves the body no step of the {steps} local steps"
        )
    partition = head_and_body(head, head_label="personal", body_label="shared")
    return synchronous(loss_fn, _with_partition(options, partition), alternating(head_steps, head))


@preset()
def fedbabu(
    loss_fn: LossFn,
    *,
    head: str | None = None,
    finetune_steps: int = 5,
    finetune_lr: float | None = None,
    options: Options,
) -> Algorithm:
    """FedBABU (Oh, Kim, Yun, "FedBABU: Toward Enhanced Representation for Federated Image
    Classification", ICLR 2022): the head stays at its random initialisation during
    federated training (frozen: no gradient, never sent); FedAvg on the body. Personal
    models: the whole model fine-tuned by `finetune_steps` local SGD steps of size
    `finetune_lr` (None: the client learning rate) on the client's data
    (`personal_models.fine_tuned`, as FedAvg-FT)."""
    lr = check_finetune("FedBABU", finetune_steps, finetune_lr, options)
    partition = head_and_body(head, head_label="frozen", body_label="shared")
    algorithm = synchronous(loss_fn, _with_partition(options, partition))
    return algorithm._replace(personalize=fine_tuned(loss_fn, finetune_steps, lr, options.local))
