# %% [markdown]
# # Federated LoRA: pretrain centrally, fine-tune adapters on clients
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/10_federated_lora.ipynb)
#
# Fine-tuning a pretrained model on clients is where LoRA (Hu et al. 2021) pays: each adapted
# kernel `W [d_in, d_out]` gets two small adapters `A [d_in, r]`, `B [r, d_out]` and the layer
# computes `x W + (alpha / r) (x A) B`. In fedjax_sim the adapters are a **partition** of the
# parameters (`algorithms.lora.lora_partition()`: adapters shared, the base frozen), so every
# preset, aggregator and server optimizer trains and sends only the adapters, and the frozen
# base lives once, broadcast to the vmapped clients.
#
# Here: a tiny decoder-only transformer on the synthetic next-token task `markov_tokens`
# (each client's sequences follow its own Markov chain, mixed with a shared one). The base is
# pretrained centrally on a few clients' data (the "public" data), then FedAvg fine-tunes the
# adapters on the other clients. We compare with federated full fine-tuning: accuracy, and the
# bytes each client sends.

# %%
# Install fedjax_sim (skipped when it is already importable, e.g. in a local checkout).
import importlib.util

if importlib.util.find_spec("fedjax_sim") is None:
    %pip install -q "fedjax_sim @ git+https://github.com/fedjax-sim/fedjax_sim"

# %% [markdown]
# ## Parameters
# `SMALL = True` runs a reduced version (CI executes every notebook that way).

# %% tags=["parameters"]
SMALL = False

# %%
NUM_CLIENTS = 24  # the first PUBLIC clients' data pretrain the base; the others fine-tune
PUBLIC = 4
VOCAB, CONTEXT = 16, 16
RANK = 4
PRETRAIN_STEPS = 30 if SMALL else 100
ROUNDS = 4 if SMALL else 20
EVAL_EVERY = 2 if SMALL else 5

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from fedjax_sim import CohortSpec, EvalSpec, LocalSpec, fedavg, simulate
from fedjax_sim.algorithms.lora import lora_partition
from fedjax_sim.data import markov_tokens
from fedjax_sim.data.federated import Batch, tree_size_bytes
from fedjax_sim.models import transformer
from fedjax_sim.models.transformer import with_pretrained

data, test = markov_tokens(num_clients=NUM_CLIENTS, examples_per_client=48,
                           vocab_size=VOCAB, seq_len=CONTEXT, heterogeneity=0.3)  # fmt: skip
public = jax.tree.map(lambda a: a[:PUBLIC], data)  # clients 0..PUBLIC-1
train = jax.tree.map(lambda a: a[PUBLIC:], data)
shape = dict(d_model=32, num_layers=2, num_heads=2)
base_model = transformer((CONTEXT,), VOCAB, **shape)
lora_model = transformer((CONTEXT,), VOCAB, lora_rank=RANK, lora_alpha=2.0 * RANK, **shape)
print(f"{train.num_clients} fine-tuning clients, {int(train.counts.sum())} training windows")

# %% [markdown]
# ## Central pretraining
# A few Adam steps on the pooled public windows: the base learns the shared chain, not the
# clients' own ones.

# %%
x = jnp.concatenate([public.x[i, :n] for i, n in enumerate(public.counts)])
y = jnp.concatenate([public.y[i, :n] for i, n in enumerate(public.counts)])
opt = optax.adam(3e-3)
base = base_model.init(jax.random.key(0))


@jax.jit
def pretrain_step(params, opt_state, key):
    idx = jax.random.randint(key, (32,), 0, x.shape[0])
    batch = Batch(x[idx], y[idx], jnp.ones(32))
    loss, grads = jax.value_and_grad(base_model.loss)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


opt_state = opt.init(base)
for step in range(PRETRAIN_STEPS):
    base, opt_state, loss = pretrain_step(base, opt_state, jax.random.key(step))
print(f"pretrained {PRETRAIN_STEPS} steps, last batch loss {float(loss):.3f}")

# %% [markdown]
# ## Federated fine-tuning: the adapters vs the full model
# The LoRA model takes the pretrained base (`with_pretrained`: the adapters keep their
# initialisation, `B = 0`, so it starts as the base exactly). The same FedAvg runs twice:
# with `partition=lora_partition()` (adapters only) and on every parameter.

# %%
lora_params = with_pretrained(lora_model.init(jax.random.key(1)), base)
spec = dict(client_optimizer=0.5, local=LocalSpec(steps=5, batch_size=8),
            cohort=CohortSpec(size=8))  # fmt: skip
lora_fedavg = fedavg(lora_model.loss, partition=lora_partition(), **spec)
runs = {
    "LoRA (adapters)": (lora_model, lora_params, lora_fedavg),
    "full fine-tuning": (base_model, base, fedavg(base_model.loss, **spec)),
}
histories, states = {}, {}
for name, (model, params, alg) in runs.items():
    histories[name], states[name] = simulate(
        alg, train, jax.random.key(2), model=model, params=params, num_rounds=ROUNDS,
        test=test, evaluation=EvalSpec(every=EVAL_EVERY), progress=False, return_state=True,
    )  # fmt: skip
    rounds, acc = histories[name].eval_series("test_accuracy")
    sent = histories[name].metric("bytes_up")[-1] / spec["cohort"].size
    print(f"{name}: test accuracy {acc[0]:.3f} (round 0: the pretrained base) -> {acc[-1]:.3f} "
          f"(round {rounds[-1]}), sent per client per round {sent / 1e3:.1f} kB")  # fmt: skip

# %% [markdown]
# ## Bytes: adapters vs full model
# `bytes_up` counts what the cohort sends: with LoRA only the adapters (the rank-r matrices of
# every projection), a few percent of the model.

# %%
adapter_bytes = tree_size_bytes(lora_partition().select(lora_params, lora_params, "shared"))
full_bytes = tree_size_bytes(base)
print(f"adapters {adapter_bytes / 1e3:.1f} kB vs full model {full_bytes / 1e3:.1f} kB "
      f"({100 * adapter_bytes / full_bytes:.1f} %)")  # fmt: skip

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3))
for name, h in histories.items():
    r, acc = h.eval_series("test_accuracy")
    ax1.plot(r, acc, marker="o", label=name)
    ax2.plot(np.cumsum(h.metric("bytes_up")) / 1e6, label=name)
ax1.set(xlabel="round", ylabel="test accuracy", title="accuracy")
ax2.set(xlabel="round", ylabel="MB sent (cumulative)", title="uplink", yscale="log")
ax1.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Merging
# `merge_lora` folds the trained adapters into the kernels (`W + (alpha / r) A B`): a plain
# transformer that predicts exactly what the LoRA model does.

# %%
from fedjax_sim.models.transformer import lora_scale, merge_lora

tuned = states["LoRA (adapters)"].params
merged = merge_lora(tuned, lora_scale(RANK, 2.0 * RANK))
xs = jnp.asarray(test.x[:16])
gap = jnp.max(jnp.abs(lora_model.apply(tuned, xs) - base_model.apply(merged, xs)))
print(f"max |LoRA model - merged plain model| logit: {float(gap):.2e}")

# %% [markdown]
# ## Heterogeneous ranks
# Clients with less memory can train fewer ranks. `hetlora_fedavg` is FedAvg with HetLoRA's
# aggregation (Cho et al. 2024: each client's modules zero-padded to the full rank, averaged
# with weights `||A_i B_i||`); `client_ranks` gives client i the rank `ranks[i mod 3]`, the
# CLI's `--lora-rule hetlora --lora-ranks 1 2 4`. `bytes_up` counts each client's true rank.

# %%
from fedjax_sim.algorithms.lora import client_ranks, hetlora_fedavg

ranks = client_ranks([1, 2, RANK], train.num_clients)
het = hetlora_fedavg(lora_model.loss, ranks=ranks, partition=lora_partition(), **spec)
histories["HetLoRA (ranks 1, 2, 4)"] = simulate(
    het, train, jax.random.key(2), model=lora_model, params=lora_params, num_rounds=ROUNDS,
    test=test, evaluation=EvalSpec(every=EVAL_EVERY), progress=False,
)  # fmt: skip
for name in ("LoRA (adapters)", "HetLoRA (ranks 1, 2, 4)"):
    acc = histories[name].eval_series("test_accuracy")[1][-1]
    sent = histories[name].metric("bytes_up").mean() / spec["cohort"].size
    print(f"{name}: test accuracy {acc:.3f}, sent per client per round {sent / 1e3:.1f} kB")
