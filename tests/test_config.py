"""Config assembly (issue 18): every flag that names a concept reaches every algorithm that
has it, and a flag an algorithm cannot use is refused (one line, before anything runs)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import algorithms
from fedjax_sim.app.config import (
    ALGORITHM_FLAGS,
    RunConfig,
    UsageError,
    algorithm_kwargs,
    hyper_parameters,
)
from fedjax_sim.data import least_squares
from fedjax_sim.models import Model, linear_regression
from fedjax_sim.runtime.parallel import ClientMap

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
    "weighting": ("uniform", "counts"),  # one of the two differs from the base's "auto"
    "mu": 0.5,
    "clusters": 3,
    "straggler_fraction": 1.0,
    # issue 21: alone, only --dp-clip, --aggregator and --attack change a run; the others need
    # one of them (refused with a line naming the flag)
    "cohort_probability": 0.5,
    "dp_clip": 0.01,
    "dp_noise": 1.0,
    "dp_delta": 1e-6,
    "target_epsilon": 2.0,
    "dp_quantile": 0.5,
    "dp_accountant": "pld",
    "aggregator": "median",
    "aggregator_args": ("beta=0.2",),
    "secure_aggregation": (("clip=10.0", "bits=16"),),  # one value: a tuple of key=value
    # issue 38: alone, only --device-model changes a run (synchronous presets); the clock's
    # other flags need it (refused naming the flag), asynchronous presets refuse them all
    "device_model": "phones",
    "deadline": 5.0,
    "late": "partial",
    "over_selection": 1.5,
    "availability": False,
    "available_cohorts": True,
    "cohort_candidates": 2.0,
    "round_trip_latency": 0.5,
    "attack": "sign_flip",
    "byzantine_fraction": 0.5,
    "attack_args": ("scale=2.0",),
}
assert set(CHANGED) == set(ALGORITHM_FLAGS)


def _problem():
    return least_squares(num_clients=6, examples_per_client=np.arange(5, 11), dim=3, seed=0)


# presets that split the model into a body and a head (they take `head=`) run the two-layer
# linear model x @ (w_0 * w_1): the last layer w_1 is the head
TWO_LAYERS = Model(
    init=lambda key: {f"layer_{i}": {"w": jnp.linspace(-1.0, 1.0, 3) + i} for i in (0, 1)},
    apply=lambda p, x: x @ (p["layer_0"]["w"] * p["layer_1"]["w"]),
    loss_kind="squared",
)


def _final(name: str, cfg: RunConfig, explicit: set[str]):
    data = _problem().data
    kwargs = algorithm_kwargs(cfg, explicit, data=data, client_map=ClientMap("vmap"))
    headed = "head" in hyper_parameters(algorithms.ALGORITHMS[name])
    model = TWO_LAYERS if headed else linear_regression(3)
    alg = algorithms.ALGORITHMS[name](model.loss, **kwargs)
    key = jax.random.key(0)
    state = alg.init(TWO_LAYERS.init(key) if headed else {"w": jnp.linspace(-1.0, 1.0, 3)}, key)

    def two_rounds(state, data):
        return jax.lax.fori_loop(0, 2, lambda _, s: alg.step(s, data, key)[0], state)

    # LLVM -O0: the same IEEE results, less compile time (see algorithms/_async_reference.py)
    run = jax.jit(two_rounds, compiler_options={"xla_backend_optimization_level": 0})
    return np.concatenate([np.ravel(w) for w in jax.tree.leaves(run(state, data).params)])


def _base(name: str) -> RunConfig:
    """BASE, with every client firing in each event iteration for asynchronous algorithms
    (otherwise two iterations may leave the model untouched), a temperature above the
    losses (DR-DSGD's exp(l / t) overflows otherwise) and one FedRep head step."""
    takes = hyper_parameters(algorithms.ALGORITHMS[name])
    hparams = [f"{k}={v}" for k, v in BASE_HPARAMS.items() if k in takes]
    return RunConfig(algorithm=name, hparams=tuple(hparams), **BASE)


BASE_HPARAMS = {
    "firing_probability": 1.0,
    "buffer_size": 2,
    "temperature": 50.0,
    "head_steps": 1,  # FedRep: the body gets the other local steps
}


# algorithms that always average uniformly (their papers): --weighting uniform is their own
# rule (no change), --weighting counts must be refused
UNIFORM_ONLY = {"fgdro_cvar", "fgdro_kl", "fgdro_kl_adam", "local_adam", "dr_dsgd"}


# every algorithm x the common flags (one or more per concept); the other flags of a concept
# are assembled into the same object (`config._concept_values`: LocalSpec, CohortSpec, the
# aggregator, the attack) and are checked on every preset that overrides or refuses part of a
# concept (fixed local work, fixed weighting, its own cohort rule, asynchronous)
COMMON = (
    "client_lr",
    "client_lr_decay",
    "server_lr",
    "local_steps",
    "cohort_size",
    "weighting",
    "mu",
    "straggler_fraction",
    "dp_clip",
    "aggregator",
    "attack",
)
REPRESENTATIVES = (
    "fedavg",
    "fedprox",
    "scaffold",
    "fedsgd",
    "fp_fedprox",
    "dr_dsgd",
    "fgdro_cvar",
    "drfa",
    "fedlps",
    "s_fedavg",
    "fedbuff",
)


@pytest.mark.parametrize("name", sorted(algorithms.ALGORITHMS))
def test_every_common_flag_changes_the_result_or_is_refused(name):
    _check_flags(name, COMMON)


@pytest.mark.parametrize("name", REPRESENTATIVES)
def test_every_other_flag_changes_the_result_or_is_refused(name):
    _check_flags(name, [f for f in ALGORITHM_FLAGS if f not in COMMON])


def _check_flags(name, flags):
    base_cfg = _base(name)
    base = _final(name, base_cfg, set())
    assert np.isfinite(base).all()
    for flag in flags:
        values = CHANGED[flag] if isinstance(CHANGED[flag], tuple) else (CHANGED[flag],)
        outcomes = []
        for value in values:
            cfg = dataclasses.replace(base_cfg, **{flag: value})
            try:
                outcomes.append(not np.array_equal(_final(name, cfg, {flag}), base, equal_nan=True))
            except UsageError as e:
                assert f"--{flag.replace('_', '-')}" in str(e)
                outcomes.append("refused")
            except (ValueError, TypeError) as e:  # the algorithm's own check (CLI: exit 2)
                assert str(e)
                outcomes.append("refused")
        if flag == "weighting" and name in UNIFORM_ONLY:
            assert outcomes == [False, "refused"], (name, outcomes)
            continue
        ok = any(o is True for o in outcomes) or all(o == "refused" for o in outcomes)
        assert ok, f"{name}: --{flag} accepted but no effect ({outcomes})"


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
