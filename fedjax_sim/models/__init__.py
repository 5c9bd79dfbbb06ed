"""Models: flax networks bundled with masked losses (`Model`), and their registry."""

from collections.abc import Callable

from fedjax_sim.models.base import Model, l2_norm_sq, masked_mean
from fedjax_sim.models.lenet import lenet
from fedjax_sim.models.nets import cnn, count_params, linear_regression, logistic_regression, mlp
from fedjax_sim.models.rnn import char_gru, char_lstm, char_rnn
from fedjax_sim.models.simple_cnn import simple_cnn
from fedjax_sim.models.transformer import transformer

MODELS: dict[str, Callable[..., Model]] = {
    "logistic": logistic_regression,
    "mlp": mlp,
    "cnn": cnn,
    "lstm": char_lstm,
    "gru": char_gru,
    "lenet": lenet,
    "simple_cnn": simple_cnn,
    "transformer": transformer,
}


def build(name: str, input_shape, num_classes: int, **kwargs) -> Model:
    """Builds a registered classification model by name."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name](input_shape, num_classes, **kwargs)


__all__ = [
    "MODELS",
    "Model",
    "build",
    "char_gru",
    "char_lstm",
    "char_rnn",
    "cnn",
    "count_params",
    "l2_norm_sq",
    "lenet",
    "linear_regression",
    "logistic_regression",
    "masked_mean",
    "mlp",
    "simple_cnn",
    "transformer",
]
