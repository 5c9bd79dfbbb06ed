"""`History`: per-round metrics and periodic evaluations of a run, saved as JSON, CSV and PNG."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from typing import Any

import numpy as np


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.ndarray, Series)):
        return jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else str(float(x))
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


class Series:
    """A growable column of per-round values `[n, ...]` in one NumPy buffer, with the list
    operations `History` uses: a long run costs a few bytes per round and metric, not a
    Python object each (constant memory per round, issue 19). The capacity doubles only when
    the buffer is full, so it stays below twice the number of entries; the dtype is that of
    the first values (a later dtype is promoted to a common one, without growing), and a
    saved history records it (`History.to_dict`'s `dtypes`) so a restored column continues in
    the dtype the run produces (float32 metrics print as before a resume, ints stay ints)."""

    __slots__ = ("_data", "_n")

    def __init__(self, values: Any = (), dtype: Any = None):
        arr = np.asarray(values, dtype=dtype)
        if arr.dtype == object or arr.ndim == 0:
            raise ValueError("a Series holds [n, ...] numeric values")
        self._data, self._n = arr.copy(), len(arr)

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def capacity(self) -> int:
        """Rows allocated (the buffer's length; `len(self)` of them are used)."""
        return len(self._data)

    def extend(self, values: Any) -> None:
        values = np.asarray(values)
        if not len(values):
            return
        need = self._n + len(values)
        dtype = np.result_type(self._data.dtype, values.dtype) if self._n else values.dtype
        capacity = self.capacity if need <= self.capacity else max(need, 2 * self.capacity, 16)
        if capacity != self.capacity or dtype != self._data.dtype:
            grown = np.empty((capacity, *values.shape[1:]), dtype)
            if self._n:
                grown[: self._n] = self._data[: self._n]
            self._data = grown
        self._data[self._n : need] = values
        self._n = need

    def pop(self) -> Any:
        self._n -= 1
        return self._data[self._n]

    def tolist(self) -> list:
        return self._data[: self._n].tolist()

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        return self._data[: self._n][index]

    def __iter__(self):
        return iter(self._data[: self._n])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        view = self._data[: self._n]
        return view.astype(dtype) if dtype is not None else (view.copy() if copy else view)

    def __eq__(self, other: Any) -> bool:
        return self.tolist() == list(other)

    def __repr__(self) -> str:
        return f"Series({self.tolist()!r})"


@dataclasses.dataclass
class History:
    """Stacked per-round metrics (`metrics[name][r]` for round `rounds[r]`), evaluation
    rows (`evals`, each with its `round`; round 0 is the initial model) and per-client
    evaluation rows (`client_evals`: a `round` and `[C]` arrays, e.g. each client's
    `personal_accuracy`; saved in `history.json`, not in the CSV)."""

    rounds: list[int] = dataclasses.field(default_factory=list)
    metrics: dict[str, Series] = dataclasses.field(default_factory=dict)
    evals: list[dict[str, float]] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    client_evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    # ------------------------------------------------------------------ building
    def append_rounds(self, first_round: int, metrics: dict[str, np.ndarray]) -> None:
        """Appends a chunk of stacked metrics (leading axis = rounds)."""
        n = len(next(iter(metrics.values()))) if metrics else 0
        self.rounds.extend(range(first_round, first_round + n))
        for name, values in metrics.items():
            self.metrics.setdefault(name, Series()).extend(values)

    def truncate(self, last_round: int) -> None:
        """Drops rounds and evaluations after `last_round` (cheap if there are none)."""
        while self.rounds and self.rounds[-1] > last_round:
            self.rounds.pop()
            for values in self.metrics.values():
                values.pop()
        while self.evals and self.evals[-1]["round"] > last_round:
            self.evals.pop()
        while self.client_evals and self.client_evals[-1]["round"] > last_round:
            self.client_evals.pop()

    def append_eval(self, round_: int, values: dict[str, Any]) -> None:
        """An evaluation: scalars into `evals`, arrays (per-client values) into
        `client_evals`."""
        arrays = {k: np.asarray(v) for k, v in values.items() if np.ndim(v) > 0}
        scalars = {k: float(v) for k, v in values.items() if k not in arrays}
        self.evals.append({"round": int(round_), **scalars})
        if arrays:
            self.client_evals.append({"round": int(round_), **arrays})

    # ------------------------------------------------------------------ access
    @property
    def num_rounds(self) -> int:
        return self.rounds[-1] if self.rounds else 0

    def final(self) -> dict[str, float]:
        """The last evaluation row (empty if none)."""
        return dict(self.evals[-1]) if self.evals else {}

    def metric(self, name: str) -> np.ndarray:
        return np.asarray(self.metrics[name])

    def client_series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """`(rounds [E], values [E, C])` of a per-client evaluated value (NaN: a client
        without test examples)."""
        rows = [e for e in self.client_evals if name in e]
        values = np.array([np.asarray(e[name], dtype=float) for e in rows]).reshape(len(rows), -1)
        return np.array([e["round"] for e in rows], dtype=int), values

    def eval_series(self, name: str, x: str = "round") -> tuple[np.ndarray, np.ndarray]:
        """`(x [n], values [n])` of an evaluated metric; `x="round"`, or `"virtual_hours"`:
        the virtual clock after each evaluated round (`virtual_time` / 3600, 0 at round 0;
        runs with a `device_model`)."""
        rows = [e for e in self.evals if name in e]
        rounds, values = np.array([e["round"] for e in rows]), np.array([e[name] for e in rows])
        if x == "round":
            return rounds, values
        if x != "virtual_hours":
            raise ValueError(f"x must be round|virtual_hours, got {x!r}")
        if "virtual_time" not in self.metrics:
            raise ValueError("no virtual_time metric: run with a device_model")
        clock = dict(
            zip(self.rounds, np.asarray(self.metrics["virtual_time"]).tolist(), strict=True)
        )
        clock[0] = 0.0
        return np.array([clock[int(r)] / 3600.0 for r in rounds]), values

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict; `dtypes` names each metric column's NumPy dtype (restored by
        `from_dict`)."""
        dtypes = {k: str(v.dtype) for k, v in self.metrics.items() if isinstance(v, Series)}
        return jsonable(
            {
                "meta": self.meta,
                "rounds": self.rounds,
                "metrics": self.metrics,
                "dtypes": dtypes,
                "eval": self.evals,
                **({"client_eval": self.client_evals} if self.client_evals else {}),
            }
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> History:
        dtypes = d.get("dtypes", {})
        return cls(
            rounds=list(d.get("rounds", [])),
            metrics={k: _series(v, dtypes.get(k)) for k, v in d.get("metrics", {}).items()},
            evals=[dict(e) for e in d.get("eval", [])],
            meta=dict(d.get("meta", {})),
            client_evals=[
                {k: v if k == "round" else np.asarray(v, dtype=float) for k, v in e.items()}
                for e in d.get("client_eval", [])
            ],
        )

    @classmethod
    def load(cls, path: str) -> History:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def save(self, out_dir: str, plot: bool = True) -> dict[str, str]:
        """Writes `history.json`, `history.csv` and (if `plot`) `history.png` atomically."""
        os.makedirs(out_dir, exist_ok=True)
        paths = {
            "json": os.path.join(out_dir, "history.json"),
            "csv": os.path.join(out_dir, "history.csv"),
        }
        atomic_write(paths["json"], json.dumps(self.to_dict(), indent=1))
        atomic_write(paths["csv"], self.to_csv())
        if plot and (self.rounds or self.evals):
            paths["png"] = os.path.join(out_dir, "history.png")
            self.plot(paths["png"])
        return paths

    def to_csv(self) -> str:
        """One row per round (round 0 = initial evaluation); scalar metrics and eval columns,
        blank where a value was not computed in that round."""
        scalar = _scalar_metrics(self)
        eval_cols = sorted({k for e in self.evals for k in e} - {"round"})
        by_round: dict[int, dict[str, Any]] = {}
        for i, r in enumerate(self.rounds):
            by_round.setdefault(r, {}).update({k: self.metrics[k][i] for k in scalar})
        for e in self.evals:
            by_round.setdefault(e["round"], {}).update({k: e[k] for k in eval_cols if k in e})
        import io

        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(["round", *scalar, *eval_cols])
        for r in sorted(by_round):
            row = by_round[r]
            writer.writerow([r, *(row.get(k, "") for k in scalar + eval_cols)])
        return buf.getvalue()

    def plot(self, path: str) -> None:
        """Training loss per round and test accuracy per evaluation: central, client mean /
        worst / 10th percentile of the global model and, when evaluated, of the personal
        models and of the adapted unseen clients; with a virtual clock (`virtual_time`, runs
        with a device model) a third panel: the accuracies against virtual hours."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        clock = "virtual_time" in self.metrics and len(self.metrics["virtual_time"]) > 0
        fig, axes = plt.subplots(1, 3 if clock else 2, figsize=(16.5 if clock else 11, 4))
        if "train_loss" in self.metrics:
            axes[0].plot(self.rounds, self.metrics["train_loss"], lw=1, label="cohort train loss")
        r, v = self.eval_series("test_loss")
        if len(r):
            axes[0].plot(r, v, "o-", ms=3, label="central test loss")
        axes[0].set(xlabel="round", ylabel="loss", yscale="log", title="Loss")
        axes[0].legend()
        labels = {  # global model (solid), personal models (dashed), unseen clients (dotted)
            "test_accuracy": ("central test", "o-"),
            "client_accuracy_mean": ("client mean", "o-"),
            "client_accuracy_worst": ("worst client", "o-"),
            "client_accuracy_p10": ("client 10th pct.", "o-"),
            "personal_accuracy_mean": ("personal mean", "s--"),
            "personal_accuracy_p10": ("personal 10th pct.", "s--"),
            "personal_accuracy_worst": ("personal worst", "s--"),
            "unseen_accuracy_mean": ("unseen mean (adapted)", "^:"),
        }
        for name, (label, style) in labels.items():
            r, v = self.eval_series(name)
            if len(r):
                axes[1].plot(r, v, style, ms=3, label=label)
        axes[1].set(xlabel="round", ylabel="accuracy", title="Accuracy", ylim=(0, 1))
        if axes[1].lines:  # none without a test set (a streamed client store)
            axes[1].legend()
        if clock:
            for name, (label, style) in labels.items():
                h, v = self.eval_series(name, x="virtual_hours")
                if len(h):
                    axes[2].plot(h, v, style, ms=3, label=label)
            axes[2].set(
                xlabel="virtual hours", ylabel="accuracy", title="Accuracy vs time", ylim=(0, 1)
            )
            if axes[2].lines:
                axes[2].legend()
        title = self.meta.get("title")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class HistoryWriter:
    """Append-only `history.csv` and `history.jsonl` (one JSON object per round or
    evaluation) in `out_dir`: each `append` writes only the rows added since the last one,
    so a run's cost per evaluation does not grow with its length. `finish` writes the
    summary `history.json` (and the plot). Nothing is written before the first `append`,
    so a run that fails before its first chunk leaves an earlier run's files untouched."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.csv_path = os.path.join(out_dir, "history.csv")
        self.jsonl_path = os.path.join(out_dir, "history.jsonl")
        self.started = False
        self._rounds = 0  # rows of history.rounds already written
        self._evals = 0  # rows of history.evals already written
        self._header: list[str] = []

    def append(self, history: History) -> None:
        """Writes the rows added to `history` since the last call (all of them the first
        time, e.g. after a resume)."""
        if not self.started:
            self._rewrite(history)
            return
        rounds = history.rounds[self._rounds :]
        evals = history.evals[self._evals :]
        if not rounds and not evals:
            return
        scalar = _scalar_metrics(history)
        eval_cols = {k for e in evals for k in e} - {"round"}
        if not set(scalar) | eval_cols <= set(self._header):
            self._rewrite(history)  # a new column: rewrite once
            return
        by_round: dict[int, dict[str, Any]] = {}
        for i, r in enumerate(rounds, start=self._rounds):
            by_round.setdefault(r, {}).update({k: history.metrics[k][i] for k in scalar})
        for e in evals:
            by_round.setdefault(e["round"], {}).update(e)
        lines = _jsonl_lines(history, self._rounds, self._evals)
        import io

        buf = io.StringIO()
        w = csv.writer(buf)
        for r in sorted(by_round):
            w.writerow([r, *(by_round[r].get(k, "") for k in self._header[1:])])
        with open(self.csv_path, "a") as f:
            f.write(buf.getvalue())
        with open(self.jsonl_path, "a") as f:
            f.write("\n".join(lines) + "\n")
        self._rounds, self._evals = len(history.rounds), len(history.evals)

    def _rewrite(self, history: History) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        text = history.to_csv()
        self._header = text.splitlines()[0].split(",") if text else ["round"]
        atomic_write(self.csv_path, text)
        lines = _jsonl_lines(history, 0, 0)
        atomic_write(self.jsonl_path, "".join(line + "\n" for line in lines))
        self._rounds, self._evals = len(history.rounds), len(history.evals)
        self.started = True

    def finish(self, history: History, plot: bool = True) -> None:
        """Flushes the last rows and writes the summary `history.json` (and `history.png`)."""
        self.append(history)
        atomic_write(
            os.path.join(self.out_dir, "history.json"), json.dumps(history.to_dict(), indent=1)
        )
        if plot and (history.rounds or history.evals):
            history.plot(os.path.join(self.out_dir, "history.png"))


def _series(values: list, dtype: str | None = None) -> Series | list:
    """A loaded metric column as a Series of `dtype` (float64 for a history saved without
    dtypes; a list if it is not numeric)."""
    try:
        return Series(values if values else np.zeros((0,)), dtype=dtype or float)
    except (TypeError, ValueError):
        return list(values)


def _jsonl_lines(history: History, first_round: int, first_eval: int) -> list[str]:
    """`history.jsonl` lines of the rounds and evaluations from these indices on, in round
    order (an evaluation after its round's metrics), so the file does not depend on how the
    run was chunked or resumed."""
    rows = [
        (r, 0, {"round": r, **{k: v[i] for k, v in history.metrics.items()}})
        for i, r in enumerate(history.rounds[first_round:], start=first_round)
    ]
    rows += [(e["round"], 1, {"round": e["round"], "eval": e}) for e in history.evals[first_eval:]]
    rows.sort(key=lambda row: row[:2])
    return [json.dumps(jsonable(row)) for _, _, row in rows]


def _scalar_metrics(history: History) -> list[str]:
    return [k for k, v in history.metrics.items() if v and np.ndim(v[0]) == 0]
