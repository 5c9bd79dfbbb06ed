"""Shared pieces of the FGDRO experiments (`fgdro_shifted_minority.py`,
`fgdro_imbalanced_fmnist.py`): the ten methods of the paper's tables (spec
`../shared/specs/fgdro.md` sections 2.5 and 5) built with one communication interval I, batch
B, full participation and uniform (1/N) averaging, plus a runner that writes one JSON row per
(method, seed) with the final worst-group / average metrics and the evaluation curves.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np

from fedjax_sim.algorithms import (
    dr_dsgd,
    drfa,
    fedadam_reddi,
    fedavg,
    fedprox,
    fgdro_cvar,
    fgdro_kl,
    fgdro_kl_adam,
    local_adam,
    scaffold,
)
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.run.dro import plot_worst_vs_average
from fedjax_sim.run.history import History
from fedjax_sim.run.simulate import EvalSpec
from fedjax_sim.run.sweep import runs_mesh, sweep

METHODS = (
    "FedAvg",
    "SCAFFOLD",
    "FedProx",
    "FedAdam",
    "DRFA",
    "DR-DSGD",
    "FGDRO-CVaR",
    "FGDRO-KL",
    "FGDRO-KL-Adam",
    "LocalAdam",
)


def build(name: str, loss, n: int, hp: dict):
    """One method with the shared I, B (`hp["I"]`, `hp["B"]`) and its tuned-by-us knobs."""
    local = LocalSpec(steps=hp["I"], batch_size=hp["B"])
    uni = CohortSpec(weighting="uniform")
    lr, alr = hp["lr"], hp["adam_lr"]
    if name == "FedAvg":
        return fedavg(loss, client_optimizer=lr, local=local, cohort=uni)
    if name == "SCAFFOLD":
        return scaffold(loss, num_clients=n, client_optimizer=lr, local=local, cohort=uni)
    if name == "FedProx":
        return fedprox(loss, mu=hp["prox_mu"], client_optimizer=lr, local=local, cohort=uni)
    if name == "FedAdam":
        return fedadam_reddi(
            loss,
            server_optimizer=hp["fedadam_server_lr"],
            eps=1e-3,
            client_optimizer=lr,
            local=local,
            cohort=uni,
        )
    if name == "DRFA":
        return drfa(loss, num_clients=n, client_optimizer=lr, dual_lr=hp["drfa_gamma"], local=local)
    if name == "DR-DSGD":
        return dr_dsgd(
            loss,
            temperature=hp["dr_dsgd_temperature"],
            client_optimizer=lr,
            local=local,
            cohort=uni,
        )
    if name == "FGDRO-CVaR":
        return fgdro_cvar(loss, num_clients=n, k=hp["K"], client_optimizer=lr, local=local)
    betas = dict(beta1=hp["beta"], beta2=hp["beta"], beta3=hp["beta"])
    if name == "FGDRO-KL":
        return fgdro_kl(
            loss,
            num_clients=n,
            temperature=hp["kl_temperature"],
            client_optimizer=lr,
            local=local,
            **betas,
        )
    if name == "FGDRO-KL-Adam":
        return fgdro_kl_adam(
            loss,
            num_clients=n,
            temperature=hp["kl_temperature"],
            client_optimizer=alr,
            local=local,
            **betas,
        )
    if name == "LocalAdam":
        return local_adam(loss, num_clients=n, client_optimizer=alr, beta3=hp["beta"], local=local)
    raise ValueError(f"unknown method {name!r}")


ADAM_LR = ("FGDRO-KL-Adam", "LocalAdam")  # step size `adam_lr`; the others' is `lr`
BETA_METHODS = ("FGDRO-KL", "FGDRO-KL-Adam")  # the methods whose rates `beta` the paper tunes


def lr_key(name: str) -> str:
    """The hp entry holding `name`'s (client) step size."""
    return "adam_lr" if name in ADAM_LR else "lr"


def run_all(
    methods, seeds, *, data, test, model, rounds, every, extra, hp, out_path, worst, mean,
    grids=None, worst_loss=None,
):  # fmt: skip
    """Runs every (method, seed): one `fedjax_sim.run.sweep.sweep` per method (run r =
    `simulate` with key(seed_r)), over seeds only or, with `grids[name]` (`{"lr": step
    sizes}`, optionally `"beta": rates}`), over that method's grid x seeds (traced: one
    compiled program); appends rows (with the row's `lr`, and `beta` where it was swept) to
    the JSON file `out_path` as it goes (`seconds` of a
    row: the method's sweep time / its number of runs). `worst_loss`: an evaluation metric
    whose curve is kept too (`curve_worst_loss`). With several devices (e.g.
    `XLA_FLAGS=--xla_force_host_platform_device_count=2`) the runs are sharded over them."""
    rows = []
    seeds = [int(s) for s in seeds]
    for name in methods:
        grid = (grids or {}).get(name)
        alg = build(name, model.loss, data.num_clients, hp)

        def make(hparams, alg=alg, name=name):  # one compiled program for all runs
            if not hparams:
                return alg
            swept = {lr_key(name) if k == "lr" else k: v for k, v in hparams.items()}
            return build(name, model.loss, data.num_clients, {**hp, **swept})

        t0 = time.perf_counter()
        res = sweep(
            make, data, seeds=seeds, model=model, num_rounds=rounds, test=test,
            grid={k: list(v) for k, v in grid.items()} if grid else None,
            mesh=runs_mesh() if jax.device_count() > 1 else None,
            evaluation=EvalSpec(every=every, clients=False, extra=extra), progress=False,
        )  # fmt: skip
        seconds = (time.perf_counter() - t0) / len(res.runs)
        for run, hist in zip(res.runs, res.histories, strict=True):
            final = hist.final()
            row = {
                "method": name,
                "seed": run.seed,
                "lr": run.hparams.get("lr", hp[lr_key(name)]),
                **({"beta": run.hparams["beta"]} if "beta" in run.hparams else {}),
                "seconds": seconds,
                "worst": final[worst],
                "mean": final[mean],
                "final": final,
                "curve_rounds": hist.eval_series(worst)[0].tolist(),
                "curve_worst": hist.eval_series(worst)[1].tolist(),
                "curve_mean": hist.eval_series(mean)[1].tolist(),
                "nonfinite_round": hist.meta.get("nonfinite_round"),
            }
            if worst_loss:
                row["curve_worst_loss"] = hist.eval_series(worst_loss)[1].tolist()
            rows.append(row)
            beta = f" beta {row['beta']:g}" if "beta" in row else ""
            print(
                f"{name:14s} lr {row['lr']:<7g}{beta} seed {run.seed}: worst {row['worst']:.4f} "
                f"mean {row['mean']:.4f} ({row['seconds']:.0f} s)",
                flush=True,
            )
        with open(out_path, "w") as f:
            json.dump({"hparams": hp, "grids": grids, "rows": rows}, f, indent=1)
    return rows


def _std(v: np.ndarray) -> float:
    return float(v.std(ddof=1)) if v.size > 1 else 0.0


def _configs(rows, name: str) -> list:
    """The (lr, beta) of `name`'s rows, ascending (None for a value a row does not carry)."""
    cfgs = {(r.get("lr"), r.get("beta")) for r in rows if r["method"] == name}
    return sorted(cfgs, key=lambda c: (c[0] or 0.0, c[1] or 0.0))


def table(rows, methods, worst_loss: str | None = None) -> str:
    """Markdown table: mean (std, ddof 1) over seeds of the final worst and average metric,
    and of `final[worst_loss]` (the worst-group loss) when given."""
    head = "| method | worst | average |" + (" worst loss |" if worst_loss else "")
    lines = [head, "|---|---|---|" + ("---|" if worst_loss else "")]
    for name, (lr, beta) in [(n, c) for n in methods for c in _configs(rows, n)]:
        sel = [r for r in rows
               if r["method"] == name and (r.get("lr"), r.get("beta")) == (lr, beta)]  # fmt: skip
        tuned = ([f"lr {lr:g}"] if len(_configs(rows, name)) > 1 else []) + (
            [f"beta {beta:g}"] if beta is not None else [])  # fmt: skip
        label = f"{name} ({', '.join(tuned)})" if tuned else name
        w = np.array([r["worst"] for r in sel])
        m = np.array([r["mean"] for r in sel])
        if w.size:
            line = f"| {label} | {w.mean():.4f} ({_std(w):.4f}) | {m.mean():.4f} ({_std(m):.4f}) |"
            if worst_loss:
                v = np.array([r["final"][worst_loss] for r in sel])
                line += f" {v.mean():.4f} ({_std(v):.4f}) |"
            lines.append(line)
    return "\n".join(lines)


def plot_rows(rows, path: str, title: str) -> None:
    """Worst-group and average curves of seed 0, one line per method."""
    histories = {}
    for r in rows:
        if r["seed"] == 0:
            h = History()
            for rnd, w, m in zip(r["curve_rounds"], r["curve_worst"], r["curve_mean"], strict=True):
                h.append_eval(rnd, {"worst": w, "mean": m})
            histories[r["method"]] = h
    plot_worst_vs_average(histories, path, worst="worst", mean="mean", title=title)
