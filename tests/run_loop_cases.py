"""Small runs of every driver whose histories `test_run_loop.py` pins bit for bit.

`python tests/run_loop_cases.py` records them into `tests/run_loop_pins.npz` and the
machine's fingerprint into `tests/run_loop_pins.json` (float32 training histories: XLA:CPU
compiles for the host's instruction set, so on another machine they differ in the last bits,
and over rounds by more). Recorded with the three drivers before they shared one loop.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import jax
import numpy as np
import optax

from fedjax_sim import EvalSpec, simulate
from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg, scaffold
from fedjax_sim.data import load_digits
from fedjax_sim.data.store import ClientStore
from fedjax_sim.models import logistic_regression
from fedjax_sim.run.history import History
from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed
from fedjax_sim.run.sweep import sweep

PINS = os.path.join(os.path.dirname(__file__), "run_loop_pins.npz")
PINS_RECORD = os.path.join(os.path.dirname(__file__), "run_loop_pins.json")
C, M, ROUNDS = 24, 4, 7  # chunks of 3, 3, 1 rounds
LOCAL = LocalSpec(steps=2, batch_size=8)


def _setup():
    digits = load_digits(num_clients=C)
    model = logistic_regression(digits.feature_shape, 10)
    alg = scaffold(model.loss, num_clients=C, local=LOCAL, cohort=CohortSpec(size=M))
    return digits, model, alg


def simulate_resumed() -> History:
    """`simulate` with central, per-client and training evaluation, stopped after 3 rounds
    (checkpoint) and resumed to 7."""
    digits, model, alg = _setup()
    kw = dict(model=model, test=digits.test, progress=False, checkpoint_every=3)
    ev = EvalSpec(every=3, train=True)
    with tempfile.TemporaryDirectory() as tmp:
        simulate(
            alg,
            digits.train,
            jax.random.key(1),
            num_rounds=3,
            evaluation=ev,
            checkpoint_dir=tmp,
            **kw,
        )
        return simulate(
            alg,
            digits.train,
            jax.random.key(1),
            num_rounds=ROUNDS,
            evaluation=ev,
            checkpoint_dir=tmp,
            resume=True,
            **kw,
        )


def _streamed(state_rows: str) -> History:
    digits, model, alg = _setup()
    store = ClientStore.from_federated(digits.train)
    plan = AlgorithmCohorts(CohortSpec(size=M), store.counts)
    return simulate_streamed(
        alg,
        store,
        jax.random.key(2),
        plan=plan,
        model=model,
        num_rounds=ROUNDS,
        test=digits.test,
        evaluation=EvalSpec(every=3, clients=False),
        progress=False,
        state_rows=state_rows,
    )


def streamed_device() -> History:
    """`simulate_streamed`, state rows on device."""
    return _streamed("device")


def streamed_host() -> History:
    """`simulate_streamed`, state rows on the host."""
    return _streamed("host")


def sweep_seeds() -> list[History]:
    """`sweep`: FedAvg over 2 seeds x 2 client learning rates."""
    digits, model, _ = _setup()

    def make(hp):
        return fedavg(
            model.loss, local=LOCAL, cohort=CohortSpec(size=M), client_optimizer=optax.sgd(hp["lr"])
        )

    result = sweep(
        make,
        digits.train,
        seeds=2,
        grid={"lr": [0.05, 0.1]},
        model=model,
        num_rounds=ROUNDS,
        test=digits.test,
        evaluation=EvalSpec(every=3),
        progress=False,
    )
    return result.histories


CASES: dict[str, Callable[[], History | list[History]]] = {
    "simulate_resumed": simulate_resumed,
    "streamed_device": streamed_device,
    "streamed_host": streamed_host,
    "sweep_seeds": sweep_seeds,
}


def flatten(name: str, history: History) -> dict[str, np.ndarray]:
    """`{name/rounds, name/metric/<m>, name/eval/<m>}` arrays of a history."""
    out = {f"{name}/rounds": np.asarray(history.rounds)}
    for k, v in history.metrics.items():
        out[f"{name}/metric/{k}"] = np.asarray(v)
    keys = sorted({k for e in history.evals for k in e})
    for k in keys:
        out[f"{name}/eval/{k}"] = np.asarray([e.get(k, np.nan) for e in history.evals])
    return out


def record(name: str) -> dict[str, np.ndarray]:
    """The flattened histories of case `name` (sweeps: `name/run<r>/...`)."""
    got = CASES[name]()
    if isinstance(got, list):
        return {k: v for r, h in enumerate(got) for k, v in flatten(f"{name}/run{r}", h).items()}
    return flatten(name, got)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("FEDJAX_SIM_AUTOTUNE", "0")
    arrays = {k: v for name in CASES for k, v in record(name).items()}
    np.savez(PINS, **arrays)
    import machine

    with open(PINS_RECORD, "w") as f:
        json.dump({"fingerprint": machine.fingerprint()}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{len(arrays)} arrays -> {PINS}")
