"""PNG plots of suite results (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measured rounds: `round` rows, and `measurement` rows with a round's throughput (e.g.
    rows made from printed lines)."""
    return [
        r
        for r in rows
        if r["kind"] == "round" or (r["kind"] == "measurement" and "client_steps_per_s" in r)
    ]


def plot_suite(suite: str, rows: list[dict[str, Any]], path: str) -> str | None:
    """Writes the suite's plot to `path`; None if nothing was measured."""
    measured = _measured(rows)
    if not measured:
        return None
    plt = _plt()
    if suite == "baselines" and len({r["clients"] for r in measured}) > 1:
        fig = _systems_vs_cohort(plt, measured)
    elif suite in ("cohort", "steps", "width"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        x_of = {
            "cohort": ("clients", "cohort size M (clients)"),
            "steps": ("local_steps", "local steps K"),
            "width": ("width", "MLP hidden width"),
        }[suite]
        groups: dict[str, list[dict]] = defaultdict(list)
        for r in measured:
            groups[r["workload"]["name"] if suite == "cohort" else r["mode"]].append(r)
        for name, rs in groups.items():
            xs = [r["workload"]["hidden"][0] if suite == "width" else r[x_of[0]] for r in rs]
            axes[0].plot(xs, [r["round_s_median"] for r in rs], "o-", label=name)
            axes[1].plot(xs, [r["client_steps_per_s"] for r in rs], "o-", label=name)
        for ax, ylabel in zip(axes, ("seconds / round (median)", "client-steps / s"), strict=True):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(x_of[1])
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        skipped = [r for r in rows if r["kind"] == "skipped"]
        if skipped:
            fig.text(
                0.01,
                0.01,
                f"skipped: {skipped[0]['label']} ({skipped[0]['reason'][:90]})",
                fontsize=7,
            )
    else:
        fig, ax = plt.subplots(figsize=(9, max(3.0, 0.35 * len(measured) + 1.5)))
        labels = [r["label"] for r in measured]
        if suite == "algorithms" and all("ratio_to_fedavg" in r for r in measured):
            values, xlabel = [r["ratio_to_fedavg"] for r in measured], "round time / FedAvg's"
            ax.axvline(1.0, color="k", lw=0.8)
        elif suite == "memory":
            values = [r["peak_memory_bytes"] / 2**30 for r in measured]
            xlabel = "peak memory (GiB)"
        else:
            values, xlabel = [r["round_s_median"] for r in measured], "seconds / round (median)"
        ax.barh(range(len(values)), values, color="tab:blue")
        ax.set_yticks(range(len(values)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.grid(True, axis="x", alpha=0.3)
    m = measured[0]["machine"]
    fig.suptitle(
        f"{suite}: {m['device_kind']}, jax {m['jax']}, load avg {m['load_avg_1m']}", fontsize=10
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _systems_vs_cohort(plt, measured: list[dict[str, Any]]):
    """Client-steps/s against the cohort size, one line per system (`system`, else the
    label), one panel per workload (the baselines suite run with `--baseline-cohorts`)."""
    names = list(dict.fromkeys(r["workload"]["name"] for r in measured))
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        groups: dict[str, list[dict]] = defaultdict(list)
        for r in measured:
            if r["workload"]["name"] == name:
                groups[r.get("system", r["label"])].append(r)
        for system, rs in groups.items():
            rs = sorted(rs, key=lambda r: r["clients"])
            xs, ys = [r["clients"] for r in rs], [r["client_steps_per_s"] for r in rs]
            ax.plot(xs, ys, "o-" if rs[0]["engine"] == "fedjax_sim" else "s--", label=system)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cohort size M (clients per round)")
        ax.set_ylabel("client-steps / s (median round)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return fig
