"""Human-readable forms of result rows: one log line, a markdown table per suite."""

from __future__ import annotations

from typing import Any


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _gib(b: Any) -> str:
    return "–" if not b else f"{b / 2**30:.2f}"


STAMPS = {"kind", "suite", "label", "time", "commit", "machine", "load", "command", "isolated"}


def _value(v: Any) -> str:
    """A summary field: numbers rounded, dicts as `key value; ...`, lists joined."""
    if isinstance(v, dict):
        return "; ".join(f"{k} {_value(x)}" for k, x in v.items()) or "none"
    if isinstance(v, list):
        return ", ".join(_value(x) for x in v) or "none"
    return "none" if v is None else _fmt(v)


def summary_text(row: dict[str, Any]) -> str:
    """A summary row's own fields as `name: value, ...` (not its stamps)."""
    body = {k: v for k, v in row.items() if k not in STAMPS}
    return ", ".join(f"{k.replace('_', ' ')}: {_value(v)}" for k, v in body.items())


def one_line(row: dict[str, Any]) -> str:
    if row["kind"] == "skipped":
        return f"[{row['suite']}] {row['label']}: skipped ({row['reason']})"
    if row["kind"] == "summary":
        return f"[{row['suite']}] {row['label']}: {summary_text(row)}"
    roof = row.get("roofline_ratio")
    return (
        f"[{row['suite']}] {row['label']}: {row['round_s_median']:.4g} s/round "
        f"(min {row['round_s_min']:.4g}, compile {_fmt(row['compile_s'])} s), "
        f"{row['client_steps_per_s']:,.0f} client-steps/s"
        + (f", roofline {roof:.1%}" if roof is not None else "")
        + f", peak mem {_gib(row['peak_memory_bytes'])} GiB"
    )


COLUMNS = (
    ("label", "configuration"),
    ("clients", "M"),
    ("local_steps", "K"),
    ("compile_s", "compile s"),
    ("round_s_median", "s/round (median)"),
    ("round_s_min", "s/round (min)"),
    ("client_steps_per_s", "client-steps/s"),
    ("examples_per_s", "examples/s"),
    ("achieved_gflops", "GFLOP/s (XLA)"),
    ("roofline_ratio", "roofline"),
    ("peak_memory_gib", "peak mem GiB"),
)


def markdown(rows: list[dict[str, Any]]) -> str:
    """A table of the measured rows, extra columns for ratios, then skipped rows and the
    summary as bullet points."""
    measured = [r for r in rows if r["kind"] == "round"]
    extra = [
        k
        for k in ("ratio_to_fedavg", "ratio_to_fedavg_per_client")
        if any(k in r for r in measured)
    ]
    head = [h for _, h in COLUMNS] + extra
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in measured:
        vals = dict(r)
        flops = r.get("achieved_flops_per_s")
        vals["achieved_gflops"] = None if flops is None else flops / 1e9
        vals["peak_memory_gib"] = _gib(r["peak_memory_bytes"])
        roof = r.get("roofline_ratio")
        vals["roofline_ratio"] = None if roof is None else f"{roof:.1%}"
        cells = [_fmt(vals.get(k)) for k, _ in COLUMNS] + [_fmt(r.get(k)) for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if r["kind"] == "skipped":
            lines.append(f"- skipped {r['label']}: {r['reason']}")
    for r in rows:
        if r["kind"] == "summary":
            lines.append(f"- {r['label']}: {summary_text(r)}")
    if measured:
        m = measured[0]["machine"]
        peak = measured[0]["peak_flops_per_s"] / 1e9
        lines.append(
            f"- machine: {m['device_kind']} ({m['backend']}, {m['cpu_count']} cores), jax "
            f"{m['jax']}, load average {m['load_avg_1m']} at the first measurement; matmul "
            f"peak {peak:.0f} GFLOP/s (same run)"
        )
    return "\n".join(lines)
