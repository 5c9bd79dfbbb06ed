"""Size buckets: cut padding waste by padding clients of similar size together.

`FederatedData` pads every client to the largest one, `N_max`, so a skewed size distribution
wastes `sum_i (N_max - n_i)` rows. `size_buckets(counts, B)` groups clients into B buckets of
contiguous sizes that minimise the total padded rows `sum_b |bucket b| * max_{i in b} n_i`
(exact dynamic programme over the distinct sizes); `pack_buckets` then packs one
`FederatedData` per bucket, each padded only to its own largest client.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedjax_sim.data.federated import FederatedData, pack

MAX_CANDIDATES = 1024  # distinct sizes beyond this are coarsened to quantiles (approximate DP)


class Buckets(NamedTuple):
    """Bucket assignment of C clients.

    Attributes:
      bucket_of_client: `[C]` int, bucket of each client (0 = smallest sizes).
      max_counts: `[B]` padded rows per client in each bucket.
      padded_rows: total padded slots `sum_b |b| max_counts[b]` (>= number of examples).
      waste: `padded_rows - sum_i n_i`.
      waste_unbucketed: `C N_max - sum_i n_i` (a single bucket).
    """

    bucket_of_client: np.ndarray
    max_counts: np.ndarray
    padded_rows: int
    waste: int
    waste_unbucketed: int

    def clients(self, b: int) -> np.ndarray:
        """Client ids in bucket b, ascending."""
        return np.flatnonzero(self.bucket_of_client == b)


def size_buckets(counts: np.ndarray, num_buckets: int) -> Buckets:
    """Optimal grouping of clients by size into at most `num_buckets` buckets."""
    counts = np.asarray(counts, np.int64)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"counts must be a non-empty 1-D array, got shape {counts.shape}")
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    sizes, mult = np.unique(counts, return_counts=True)
    if sizes.size > MAX_CANDIDATES:  # bucket maxima restricted to quantiles of distinct sizes
        keep = np.unique(np.linspace(0, sizes.size - 1, MAX_CANDIDATES).round().astype(int))
        grouped = np.searchsorted(sizes[keep], sizes)  # each size -> next candidate max
        sizes, mult = sizes[keep], np.bincount(grouped, weights=mult).astype(np.int64)
    u = sizes.size
    cum = np.concatenate([[0], np.cumsum(mult)])  # clients with candidate index < k
    ends = np.arange(u + 1)
    # slots[a, b]: padded rows of one bucket holding candidates a..b-1 (padded to sizes[b-1])
    slots = sizes[np.maximum(ends - 1, 0)][None, :] * (cum[None, :] - cum[:, None])
    slots = np.where(ends[:, None] < ends[None, :], slots, np.inf)
    best = np.full(u + 1, np.inf)  # best[b]: fewest slots covering candidates 0..b-1
    best[0] = 0.0
    choice = np.zeros((num_buckets, u + 1), np.int64)  # start of the last bucket, -1 = none
    for k in range(num_buckets):  # loop over buckets (B is small), vectorised over (a, b)
        cand = best[:, None] + slots
        start = cand.argmin(axis=0)
        value = cand[start, ends]
        better = value < best
        choice[k] = np.where(better, start, -1)
        best = np.where(better, value, best)
    # backtrack from the full set
    stops, b, k = [], u, num_buckets - 1
    while b > 0:
        while choice[k, b] < 0:  # best[b] was last improved at an earlier level
            k -= 1
        stops.append(b)
        b, k = int(choice[k, b]), k - 1
    bucket_max = sizes[np.array(stops[::-1]) - 1]
    bucket_of_client = np.searchsorted(bucket_max, counts).astype(np.int32)
    padded = int((bucket_max[bucket_of_client]).sum())
    total = int(counts.sum())
    return Buckets(
        bucket_of_client=bucket_of_client,
        max_counts=bucket_max,
        padded_rows=padded,
        waste=padded - total,
        waste_unbucketed=int(counts.size * counts.max() - total),
    )


class Bucket(NamedTuple):
    """One bucket: `clients [C_b]` (global client ids, ascending) and their packed data
    (row k of `data` is client `clients[k]`)."""

    clients: np.ndarray
    data: FederatedData


def pack_buckets(
    x: np.ndarray,
    y: np.ndarray,
    client_ids: np.ndarray,
    num_clients: int,
    num_buckets: int,
    *,
    num_classes: int = 0,
) -> tuple[list[Bucket], Buckets]:
    """Like `pack`, but one `FederatedData` per size bucket (see `size_buckets`)."""
    client_ids = np.asarray(client_ids, np.int64)
    counts = np.bincount(client_ids[client_ids >= 0], minlength=num_clients)
    buckets = size_buckets(counts, num_buckets)
    local = np.zeros(num_clients, np.int64)  # index of each client inside its bucket
    out = []
    for b in range(buckets.max_counts.size):
        members = buckets.clients(b)
        local[members] = np.arange(members.size)
        rows = np.flatnonzero(np.isin(client_ids, members))
        data = pack(
            x[rows],
            y[rows],
            local[client_ids[rows]],
            members.size,
            num_classes=num_classes,
            max_count=int(buckets.max_counts[b]),
        )
        out.append(Bucket(clients=members, data=data))
    return out, buckets
