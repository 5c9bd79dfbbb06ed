"""Config assembly (issue 18): every flag that names a concept reaches every algorithm that
has it, and a flag an algorithm cannot use is refused (one line, before anything runs)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import algorithms
from fedjax_sim.config import ALGORITHM_FLAGS, RunConfig, UsageError, algorithm_kwargs
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression
from fedjax_sim.parallel import ClientMap

BASE = dict(num_clients=6, cohort_size=4, local_steps=3, batch_size=4, client_lr=0.05)
# flag -> the value a test run sets (the base run uses BASE and RunConfig's defaults)
CHANGED = {
    "client_lr": 0.02,
    "client_lr_decay": 0.5,
    "server_lr": 0.5,
    "local_steps": 2,
    "local_epochs": 0.5,
    "batch_size": 2,
    "sampling": "epoch",
    "cohort_size": 3,
    "cohort_sampling": "proportional",
    "weighting": "uniform",  # "counts" where the algorithm's default is uniform
    "mu": 0.5,
    "straggler_fraction": 1.0,
}
assert set(CHANGED) == set(ALGORITHM_FLAGS)


def _problem():
    return least_squares(num_clients=6, examples_per_client=np.arange(5, 11), dim=3, seed=0)


def _final(name: str, cfg: RunConfig, explicit: set[str]):
    data = _problem().data
    kwargs = algorithm_kwargs(cfg, explicit, data=data, client_map=ClientMap("vmap"))
    alg = algorithms.ALGORITHMS[name](linear_regression(3).loss, **kwargs)
    key = jax.random.key(0)
    state = alg.init({"w": jnp.linspace(-1.0, 1.0, 3)}, key)
    step = jax.jit(alg.step)
    for _ in range(2):
        state, _ = step(state, data, key)
    return np.asarray(state.params["w"])


def _value(name: str, flag: str):
    if flag == "weighting":
        default = algorithms.ALGORITHMS[name].__signature__.parameters.get("cohort")
        if default is not None and getattr(default.default, "weighting", None) == "uniform":
            return "counts"
    return CHANGED[flag]


@pytest.mark.parametrize("name", sorted(algorithms.ALGORITHMS))
def test_every_flag_changes_the_result_or_is_refused(name):
    base_cfg = RunConfig(algorithm=name, **BASE)
    base = _final(name, base_cfg, set())
    for flag in ALGORITHM_FLAGS:
        cfg = dataclasses.replace(base_cfg, **{flag: _value(name, flag)})
        try:
            changed = _final(name, cfg, {flag})
        except UsageError as e:
            assert f"--{flag.replace('_', '-')}" in str(e) or "--" in str(e)
            continue
        except (ValueError, TypeError) as e:  # the algorithm's own check (the CLI: exit 2)
            assert str(e)
            continue
        assert not np.array_equal(changed, base), f"{name}: --{flag} accepted but no effect"


def test_unused_flag_is_refused_naming_flag_and_algorithm():
    cfg = RunConfig(algorithm="fedavg", mu=0.5)
    with pytest.raises(UsageError, match="--mu is not used by fedavg"):
        algorithm_kwargs(cfg, {"mu"})
    cfg = RunConfig(algorithm="fedsgd", client_lr=0.3)
    with pytest.raises(UsageError, match="--client-lr is not used by fedsgd"):
        algorithm_kwargs(cfg, {"client_lr"})


@pytest.mark.parametrize(
    "hparams, message",
    [
        (("rho=abc",), "rho='abc'.*number"),
        (("momentum=True",), "number"),
        (("rho=inf",), "finite"),
        (("bogus=1",), "not accepted by mofedsam"),
    ],
)
def test_hparams_are_type_checked(hparams, message):
    cfg = RunConfig(algorithm="mofedsam", hparams=hparams)
    with pytest.raises(UsageError, match=message):
        algorithm_kwargs(cfg, {"hparams"})


def test_hparams_reach_the_algorithm():
    cfg = RunConfig(algorithm="fedmim", hparams=("momentum=[0.5]", "lookahead=(0.25,)"))
    kwargs = algorithm_kwargs(cfg, {"hparams"})
    assert kwargs["momentum"] == (0.5,) and kwargs["lookahead"] == (0.25,)
