"""Natural (group-column) splits, the imbalanced-classes Dirichlet protocol of the FGDRO
paper's appendix, and the shifted-minority synthetic problem."""

import numpy as np
import pytest

from fedjax_sim.data import federate, partition
from fedjax_sim.data.federated import unpack
from fedjax_sim.data.partition import imbalanced_dirichlet
from fedjax_sim.data.synthetic import shifted_minority


def test_natural_partitioner_end_to_end_from_group_column():
    """Every example lands on the client of its group (clients in sorted group order), with a
    per-client held-out split; the group column may hold strings."""
    rng = np.random.default_rng(0)
    names = np.array(["hospital_b", "hospital_a", "hospital_c"])
    groups = names[rng.integers(0, 3, size=300)]
    x = np.arange(300, dtype=np.float32)[:, None]  # feature = example index
    y = rng.integers(0, 2, size=300).astype(np.int32)
    ds = federate(
        x, y, num_clients=3, partitioner="natural", groups=groups, client_test_fraction=0.25
    )
    order = np.sort(names)
    for split in (
        ds.train,
        ds.train.replace(x=ds.train.x_test, y=ds.train.y_test, counts=ds.train.test_counts),
    ):
        xs, ys, ids = unpack(split)
        idx = xs[:, 0].astype(int)
        np.testing.assert_array_equal(groups[idx], order[ids])
        np.testing.assert_array_equal(ys, y[idx])
    total = np.asarray(ds.train.counts) + np.asarray(ds.train.test_counts)
    np.testing.assert_array_equal(total, [np.sum(groups == g) for g in order])
    with pytest.raises(ValueError, match="3 distinct groups but num_clients=4"):
        partition("natural", y, 4, groups=groups)
    with pytest.raises(ValueError, match="one id per example"):
        partition("natural", y, 3, groups=groups[:10])


def test_imbalanced_dirichlet_reduces_classes_and_assigns_kept_once():
    labels = np.repeat(np.arange(10), 500)
    ids = imbalanced_dirichlet(labels, 20, seed=3, alpha=0.3)
    kept = ids >= 0
    assert ids.max() < 20
    per_class = np.bincount(labels[kept], minlength=10)
    np.testing.assert_array_equal(per_class, [500] * 5 + [100] * 5)  # classes 5-9 keep 20%
    np.testing.assert_array_equal(ids, imbalanced_dirichlet(labels, 20, seed=3, alpha=0.3))
    ds = federate(
        np.zeros((labels.size, 2), np.float32),
        labels,
        num_clients=20,
        partitioner="imbalanced_dirichlet",
        alpha=0.3,
        client_test_fraction=0.0,
    )
    assert int(np.sum(ds.train.counts)) == kept.sum()


def test_imbalanced_dirichlet_alpha_controls_label_skew():
    """Mean total-variation distance between client and global label distributions is large
    for Dirichlet(0.3) and small for Dirichlet(10) (the paper's two settings)."""
    labels = np.repeat(np.arange(10), 1000)

    def skew(alpha):
        ids = imbalanced_dirichlet(labels, 50, seed=0, alpha=alpha)
        kept = ids >= 0
        table = np.zeros((50, 10))
        np.add.at(table, (ids[kept], labels[kept]), 1)
        dist = table[table.sum(1) > 0]
        dist /= dist.sum(1, keepdims=True)
        glob = table.sum(0) / table.sum()
        return 0.5 * np.abs(dist - glob).sum(1).mean()

    assert skew(0.3) > 0.4 and skew(10.0) < 0.15


def test_shifted_minority_has_shifted_features_and_a_different_rule():
    x, y, groups = shifted_minority(num_clients=5, examples_per_client=2000, dim=4, shift=3.0)
    minority = groups == 4
    assert x[minority, 0].mean() == pytest.approx(3.0, abs=0.1)
    assert abs(x[~minority, 0].mean()) < 0.1
    x0, y0, g0 = shifted_minority(
        num_clients=5, examples_per_client=2000, dim=4, shift=3.0, angle=0.0
    )
    np.testing.assert_array_equal(x0, x)
    np.testing.assert_array_equal(y0[~minority], y[~minority])  # same majority rule
    agree = np.mean(y0[minority] == y[minority])  # angle 0 = majority rule on centred x
    assert agree < 0.9
    with pytest.raises(ValueError, match="num_minority"):
        shifted_minority(num_clients=3, num_minority=3)
