"""Synthetic federated problems: the FedProx recipe, least squares with a closed form and a
next-token task (per-client Markov chains)."""

from __future__ import annotations

import dataclasses

import numpy as np

from fedjax_sim.data.federated import ArrayData, FederatedData, pack, with_client_test


def fedprox_synthetic(
    alpha: float,
    beta: float,
    *,
    num_clients: int = 30,
    iid: bool = False,
    dim: int = 60,
    num_classes: int = 10,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> tuple[FederatedData, ArrayData]:
    """Synthetic(alpha, beta) of Li et al. (FedProx, MLSys 2020), exact recipe.

    Client k: `n_k = int(LogNormal(4, 2)) + 50`; `u_k ~ N(0, alpha^2)` shared by W and b,
    `B_k ~ N(0, beta^2)`; `W_k ~ N(u_k, 1)` ([dim, classes]), `b_k ~ N(u_k, 1)`,
    `v_k ~ N(B_k, 1)` elementwise; `x ~ N(v_k, diag(j^-1.2))`; `y = argmax(W_k^T x + b_k)`.
    IID variant (the authors' `iid=1`): one global `W, b ~ N(0, 1)` and `v_k = B_k * 1`.
    Each client's examples are shuffled and split 90/10 into train/test.

    Returns `(train with per-client test split, pooled central test set)`.
    """
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got {alpha}, {beta}")
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + 50
    mean_w = rng.normal(0, alpha, num_clients)
    b_shift = rng.normal(0, beta, num_clients)
    cov_diag = np.arange(1, dim + 1, dtype=np.float64) ** -1.2
    if iid:
        mean_x = np.repeat(b_shift[:, None], dim, axis=1)
        w = np.broadcast_to(rng.normal(0, 1, (dim, num_classes)), (num_clients, dim, num_classes))
        b = np.broadcast_to(rng.normal(0, 1, num_classes), (num_clients, num_classes))
    else:
        mean_x = rng.normal(b_shift[:, None], 1, (num_clients, dim))
        w = rng.normal(mean_w[:, None, None], 1, (num_clients, dim, num_classes))
        b = rng.normal(mean_w[:, None], 1, (num_clients, num_classes))
    owner = np.repeat(np.arange(num_clients), sizes)
    x = mean_x[owner] + rng.normal(size=(owner.size, dim)) * np.sqrt(cov_diag)
    logits = np.einsum("nd,ndk->nk", x, w[owner]) + b[owner]
    y = np.argmax(logits, axis=1).astype(np.int32)
    # per-client shuffle, first 90% train: rank of each example inside its client
    order = np.lexsort((rng.uniform(size=owner.size), owner))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank = np.empty(owner.size, np.int64)
    rank[order] = np.arange(owner.size) - starts[owner[order]]
    n_train = (sizes * (1 - test_fraction)).astype(np.int64)
    is_train = rank < n_train[owner]
    x = x.astype(np.float32)
    train = pack(x[is_train], y[is_train], owner[is_train], num_clients, num_classes=num_classes)
    test = pack(x[~is_train], y[~is_train], owner[~is_train], num_clients, num_classes=num_classes)
    return with_client_test(train, test), ArrayData(x=x[~is_train], y=y[~is_train])


@dataclasses.dataclass(frozen=True)
class QuadraticProblem:
    """Federated least squares `f_i(w) = (1 / (2 n_i)) ||A_i w - b_i||^2` with closed forms.

    `data` holds `A_i` rows as features and `b_i` as float labels; pair it with
    `fedjax_sim.models.linear_regression(dim)` (params `{"w": [dim]}`, squared loss
    `0.5 (a.w - b)^2`). The objective weighted by `weights` (default `n_i / N`) is
    `f(w) = sum_i weights_i f_i(w) = 1/2 w'Hw - c'w + const`.
    """

    data: FederatedData
    hessians: np.ndarray  # [C, d, d]   H_i = A_i' A_i / n_i
    linear: np.ndarray  # [C, d]        c_i = A_i' b_i / n_i

    @property
    def num_clients(self) -> int:
        return self.hessians.shape[0]

    def weights(self, weighting: str = "counts") -> np.ndarray:
        counts = np.asarray(self.data.counts, np.float64)
        w = counts if weighting == "counts" else (counts > 0).astype(np.float64)
        return w / w.sum()

    def client_optima(self) -> np.ndarray:
        """`[C, d]` minimisers of each f_i."""
        return np.linalg.solve(self.hessians, self.linear[..., None])[..., 0]

    def optimum(self, weights: np.ndarray | None = None) -> np.ndarray:
        """Minimiser of `sum_i weights_i f_i`."""
        w = self.weights() if weights is None else np.asarray(weights, np.float64)
        return np.linalg.solve(
            np.einsum("i,ijk->jk", w, self.hessians), np.einsum("i,ij->j", w, self.linear)
        )

    def fedavg_fixed_point(
        self, lr: float, local_steps: int, weights: np.ndarray | None = None
    ) -> np.ndarray:
        """Fixed point of FedAvg with full participation, `local_steps` full-batch GD steps of
        size `lr` and server lr 1.

        K local steps map `w -> w_i* + M_i (w - w_i*)` with `M_i = (I - lr H_i)^K`; averaging
        with weights p_i gives `w = sum_i p_i [M_i w + (I - M_i) w_i*]`, so
        `w_fp = [sum_i p_i (I - M_i)]^{-1} sum_i p_i (I - M_i) w_i*`. This differs from the
        optimum `[sum p_i H_i]^{-1} sum p_i c_i` whenever K > 1 and the H_i differ (client
        drift); it equals it for K = 1 or identical clients.
        """
        p = self.weights() if weights is None else np.asarray(weights, np.float64)
        d = self.hessians.shape[-1]
        step = np.eye(d)[None] - lr * self.hessians  # [C, d, d]
        # (I - M_i) w_i* = sum_{k<K} step_i^k lr c_i  (no inverse: empty clients have H_i = 0)
        power, offset = np.broadcast_to(np.eye(d), step.shape), np.zeros_like(self.linear)
        for _ in range(local_steps):
            offset = offset + lr * np.einsum("ijk,ik->ij", power, self.linear)
            power = power @ step
        lhs = np.einsum("i,ijk->jk", p, np.eye(d)[None] - power)
        return np.linalg.solve(lhs, np.einsum("i,ij->j", p, offset))


def least_squares(
    *,
    num_clients: int = 8,
    examples_per_client: int | np.ndarray = 20,
    dim: int = 5,
    heterogeneity: float = 1.0,
    noise: float = 0.1,
    identical: bool = False,
    seed: int = 0,
) -> QuadraticProblem:
    """A heterogeneous federated least-squares problem.

    Client i draws features `A_i ~ N(mu_i, s_i^2)` with client-specific scale and shift (so the
    Hessians differ) and targets `b_i = A_i w_i + noise` with `w_i ~ N(0, 1) + heterogeneity *
    N(0, 1)` around a shared `w_0`. `identical=True` copies client 0's data to every client.
    `examples_per_client` may be an int or a `[C]` array (0 allowed).
    """
    rng = np.random.default_rng(seed)
    sizes = np.broadcast_to(np.asarray(examples_per_client, np.int64), (num_clients,)).copy()
    if sizes.min() < 0:
        raise ValueError("examples_per_client must be >= 0")
    w0 = rng.normal(size=dim)
    if identical:
        sizes[:] = sizes[0]
    owner = np.repeat(np.arange(num_clients), sizes)
    scale = rng.uniform(0.5, 1.5, (num_clients, dim))
    shift = heterogeneity * rng.normal(size=(num_clients, dim)) * 0.5
    w_true = w0 + heterogeneity * rng.normal(size=(num_clients, dim))
    a = rng.normal(size=(owner.size, dim)) * scale[owner] + shift[owner]
    b = np.einsum("nd,nd->n", a, w_true[owner]) + noise * rng.normal(size=owner.size)
    if identical:
        n0 = sizes[0]
        a = np.tile(a[:n0], (num_clients, 1))
        b = np.tile(b[:n0], num_clients)
    data = pack(a.astype(np.float32), b.astype(np.float32), owner, num_clients)
    # closed forms from the float32 data actually used
    a64 = np.asarray(data.x, np.float64)
    b64 = np.asarray(data.y, np.float64)
    n = np.maximum(sizes, 1).astype(np.float64)
    hess = np.einsum("cnd,cne->cde", a64, a64) / n[:, None, None]
    lin = np.einsum("cnd,cn->cd", a64, b64) / n[:, None]
    return QuadraticProblem(data=data, hessians=hess, linear=lin)


def toy_quadratic(num_clients: int = 50, *, scale: float = 1.0) -> QuadraticProblem:
    """The AREA paper's toy problem (Appendix A.2.1): f_i(x) = (1/2)(c i x - 1)^2, x in R,
    i = 1..n, with c = `scale`.

    The paper prints c = 100, which makes every step size of its grid [1e-6, 1e-3] unstable;
    spec `area_async.md` 7.1 resolves it as c = 1 (equivalent to c = 100 with alpha / 1e4).
    Client i holds one example (feature c i, target 1); pair it with
    `linear_regression(1)` and full-batch local steps. With uniform weights the optimum is
    x* = sum_i c i / sum_i (c i)^2 (1275 / 42925 for c = 1, n = 50).
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not scale > 0:
        raise ValueError(f"scale c must be > 0, got {scale}")
    a = scale * np.arange(1, num_clients + 1, dtype=np.float64)
    ids = np.arange(num_clients)
    data = pack(a[:, None].astype(np.float32), np.ones(num_clients, np.float32), ids, num_clients)
    a32 = np.asarray(data.x, np.float64)[:, 0, 0]  # the values actually used
    return QuadraticProblem(data=data, hessians=(a32**2)[:, None, None], linear=a32[:, None])


# ------------------------------------------------------------------------------ next-token task
def markov_tokens(
    *,
    num_clients: int = 8,
    examples_per_client: int = 16,
    vocab_size: int = 16,
    seq_len: int = 8,
    heterogeneity: float = 0.5,
    min_len: int | None = None,
    test_fraction: float = 0.25,
    seed: int = 0,
) -> tuple[FederatedData, ArrayData]:
    """A federated next-token task: client k's sequences follow a Markov chain over tokens
    `1..vocab_size-1` with transitions `(1 - h) P + h P_k` (`h = heterogeneity`; rows of P and
    P_k ~ Dirichlet(0.3), so the chains are peaked and learnable); token 0 is padding.

    Each example is a window of `seq_len + 1` tokens, `x` its first `seq_len`, `y` the last
    (the layout of Shakespeare's windows, for `loss_kind="next_token"` models). With `min_len`
    (2 <= min_len <= seq_len + 1) a sequence has a length uniform in `[min_len, seq_len + 1]`
    and is right-padded with 0 (use the model's `pad_id=0`). Each client's examples are split
    in order, the last `test_fraction` as its test split. Returns `(train with per-client test
    split, pooled test set)`."""
    if vocab_size < 3 or seq_len < 1 or num_clients < 1 or examples_per_client < 2:
        raise ValueError("need vocab_size >= 3, seq_len >= 1, num_clients >= 1, examples >= 2")
    if not 0.0 <= heterogeneity <= 1.0:
        raise ValueError(f"heterogeneity must be in [0, 1], got {heterogeneity}")
    if min_len is not None and not 2 <= min_len <= seq_len + 1:
        raise ValueError(f"min_len must be in [2, {seq_len + 1}], got {min_len}")
    rng = np.random.default_rng(seed)
    v = vocab_size - 1  # real tokens 1..v
    shared = rng.dirichlet(np.full(v, 0.3), size=v)
    own = rng.dirichlet(np.full(v, 0.3), size=(num_clients, v))
    trans = (1 - heterogeneity) * shared[None] + heterogeneity * own  # [C, v, v]
    cum = np.cumsum(trans, -1)
    n, length = examples_per_client, seq_len + 1
    seq = np.empty((num_clients, n, length), np.int64)
    seq[..., 0] = rng.integers(0, v, (num_clients, n))
    for t in range(1, length):  # inverse-CDF draw of every chain's next state at once
        rows = cum[np.arange(num_clients)[:, None], seq[..., t - 1]]  # [C, n, v]
        u = rng.uniform(size=(num_clients, n, 1))
        seq[..., t] = np.minimum((rows < u).sum(-1), v - 1)
    tokens = (seq + 1).astype(np.int32)
    if min_len is not None:
        lengths = rng.integers(min_len, length + 1, (num_clients, n))
        tokens = np.where(np.arange(length) < lengths[..., None], tokens, 0).astype(np.int32)
    x, y = tokens[..., :seq_len].reshape(-1, seq_len), tokens[..., seq_len].reshape(-1)
    owner = np.repeat(np.arange(num_clients), n)
    is_train = np.tile(np.arange(n) < n - max(1, int(round(n * test_fraction))), num_clients)
    pk = dict(num_classes=vocab_size)
    train = pack(x[is_train], y[is_train], owner[is_train], num_clients, **pk)
    test = pack(x[~is_train], y[~is_train], owner[~is_train], num_clients, **pk)
    return with_client_test(train, test), ArrayData(x=x[~is_train], y=y[~is_train])


# ------------------------------------------------------------------------------ group DRO (issue 7)
def shifted_minority(
    *,
    num_clients: int = 10,
    num_minority: int = 1,
    examples_per_client: int = 200,
    dim: int = 10,
    num_classes: int = 2,
    shift: float = 2.0,
    angle: float = 90.0,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A heterogeneous classification problem with a shifted minority (group DRO's test bed).

    Majority clients: `x ~ N(0, I_dim)`, `y = argmax(x W)` with a shared `W [dim, classes]`.
    The last `num_minority` clients: `x ~ N(shift * e_1, I)` and a rule rotated by `angle`
    degrees, `y = argmax((x - shift e_1) W')` with `W' = cos(a) W + sin(a) W_perp`
    (`W_perp` orthogonal to W). No single linear model fits both, so ERM (FedAvg) serves the
    majority and leaves the minority with a high loss.

    Returns `(x [N, dim] float32, y [N] int32, groups [N] int32 = client id)`; federate it with
    `federate(x, y, num_clients=..., partitioner="natural", groups=groups)`.
    """
    if not 0 <= num_minority < num_clients:
        raise ValueError(f"num_minority must be in [0, {num_clients}), got {num_minority}")
    if examples_per_client < 1:
        raise ValueError(f"examples_per_client must be >= 1, got {examples_per_client}")
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(dim, num_classes))
    w_perp = rng.normal(size=(dim, num_classes))
    w_perp -= w * (np.sum(w * w_perp) / np.sum(w * w))  # orthogonal in Frobenius product
    w_perp *= np.linalg.norm(w) / np.linalg.norm(w_perp)
    a = np.deg2rad(angle)
    w_min = np.cos(a) * w + np.sin(a) * w_perp
    groups = np.repeat(np.arange(num_clients, dtype=np.int32), examples_per_client)
    minority = groups >= num_clients - num_minority
    center = np.zeros(dim)
    center[0] = shift
    z = rng.normal(size=(groups.size, dim))
    x = z + np.where(minority[:, None], center, 0.0)
    logits = np.where(minority[:, None], z @ w_min, z @ w)
    y = np.argmax(logits, axis=1).astype(np.int32)
    return x.astype(np.float32), y, groups
