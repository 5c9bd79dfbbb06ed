"""The table and the verdict of `federated_lora.py`, generated from its committed result file.

    PYTHONPATH=. python experiments/federated_lora_report.py            # print the table
    PYTHONPATH=. python experiments/federated_lora_report.py --write    # put it into README.md

The rule (stated in experiments/README.md, "Federated LoRA", before the runs; applied by
`decide` and `verdict`): per algorithm and LoRA variant, the paired per-seed difference of
perplexity, variant minus full fine-tuning, mean and 95% Student-t CI over the n seeds; the
margin is `MARGIN` times full fine-tuning's mean perplexity under that algorithm. n < 5:
inconclusive (n < 5); CI upper bound <= margin: matches; CI lower bound > margin: worse;
else inconclusive. The claim holds if under every algorithm a fixed-rank variant (r4, r8,
r16) matches on the global perplexity with a bytes ratio <= `MAX_BYTES_RATIO`; it fails if
that happens under no algorithm; otherwise it holds for those algorithms only.
Without the result file the block says the run is not done (and how to run it).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import readme_block

from fedjax_sim.run.sweep import mean_ci

RESULTS = os.path.join(os.path.dirname(__file__), "results", "federated_lora")
FILE = "shakespeare.json"
README = os.path.join(os.path.dirname(__file__), "README.md")
BEGIN, END = "<!-- federated_lora:begin -->", "<!-- federated_lora:end -->"
MARGIN, MAX_BYTES_RATIO, MIN_N = 0.05, 0.25, 5
ALGORITHMS = ("FedAvg", "FedProx", "FedAdam")
FIXED = ("r4", "r8", "r16")
VARIANTS = (*FIXED, "hetlora", "flora")
COMMAND = "PYTHONPATH=. nice -n 10 python experiments/federated_lora.py"


def decide(diff: np.ndarray, margin: float) -> str:
    """The rule on paired differences `diff` (variant minus full; lower is better)."""
    if diff.size < MIN_N:
        return "inconclusive (n < 5)"
    mean, half, _ = mean_ci(diff)
    if mean + half <= margin:
        return "matches"
    if mean - half > margin:
        return "worse"
    return "inconclusive"


def _by_seed(cell: dict, key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in cell["runs"]}


def paired(blob: dict, algorithm: str, variant: str, key: str) -> np.ndarray:
    """Variant minus full fine-tuning of `key`, per seed present in both."""
    a = _by_seed(blob["cells"][f"{algorithm} {variant}"], key)
    b = _by_seed(blob["cells"][f"{algorithm} full"], key)
    return np.array([a[s] - b[s] for s in sorted(set(a) & set(b))])


def bytes_ratio(blob: dict, algorithm: str, variant: str) -> float:
    total = lambda c: np.mean([r["bytes_up"] + r["bytes_down"] for r in c["runs"]])
    cells = blob["cells"]
    return float(total(cells[f"{algorithm} {variant}"]) / total(cells[f"{algorithm} full"]))


def _fmt(values: np.ndarray) -> str:
    mean, half, _ = mean_ci(values)
    return f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"


def rows(blob: dict) -> list[dict]:
    """One row per (algorithm, LoRA variant) present, with its decisions."""
    out = []
    for a in ALGORITHMS:
        if f"{a} full" not in blob["cells"]:
            continue
        full = blob["cells"][f"{a} full"]["runs"]
        margin = {k: MARGIN * np.mean([r[k] for r in full]) for k in ("global_ppl", "personal_ppl")}
        for v in VARIANTS:
            if f"{a} {v}" not in blob["cells"]:
                continue
            runs = blob["cells"][f"{a} {v}"]["runs"]
            row = {"algorithm": a, "variant": v, "n": len(runs), "ratio": bytes_ratio(blob, a, v)}
            for k in ("global_ppl", "personal_ppl"):
                d = paired(blob, a, v, k)
                row[k] = (np.mean([r[k] for r in runs]), np.mean([r[k] for r in full]))
                row[f"{k}_diff"], row[f"{k}_verdict"] = _fmt(d), decide(d, margin[k])
            out.append(row)
    return out


def verdict(table: list[dict]) -> str:
    """The claim's verdict from the rows (see the module docstring)."""
    algorithms = sorted({r["algorithm"] for r in table})
    if any(r["global_ppl_verdict"] == "inconclusive (n < 5)" for r in table):
        return "inconclusive (n < 5)"
    ok = {
        a: any(r["algorithm"] == a and r["variant"] in FIXED and r["ratio"] <= MAX_BYTES_RATIO
               and r["global_ppl_verdict"] == "matches" for r in table)
        for a in algorithms
    }  # fmt: skip
    if algorithms == sorted(ALGORITHMS) and all(ok.values()):
        return "holds"
    if not any(ok.values()):
        return "fails"
    return "holds for " + ", ".join(a for a in ALGORITHMS if ok.get(a)) + " only"


def render(blob: dict | None) -> str:
    if blob is None:
        return f"**not run** (no `results/federated_lora/{FILE}`): `{COMMAND}`"
    table = rows(blob)
    pre = blob["pretrain"]
    lines = [
        f"Base: val perplexity {pre['val_ppl']:.2f} after pretraining; global perplexity at "
        f"round 0 {blob['cells'][next(iter(blob['cells']))]['runs'][0]['base_ppl']:.2f}. "
        f"Verdict on the claim: **{verdict(table)}**.",
        "",
        "| algorithm | variant | n | global ppl (variant / full) | minus full [95% CI] | "
        "global | personal ppl (variant / full) | minus full [95% CI] | personal | bytes "
        "(up + down) / full's |",
        "|---|---|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['algorithm']} | {r['variant']} | {r['n']} | "
            f"{r['global_ppl'][0]:.3f} / {r['global_ppl'][1]:.3f} | {r['global_ppl_diff']} | "
            f"**{r['global_ppl_verdict']}** | "
            f"{r['personal_ppl'][0]:.3f} / {r['personal_ppl'][1]:.3f} | "
            f"{r['personal_ppl_diff']} | **{r['personal_ppl_verdict']}** | {r['ratio']:.3f} |"
        )
    gain = lambda runs: 100 * (1 - np.mean([r["global_ppl"] for r in runs]) / runs[0]["base_ppl"])
    gains = [f"{a} {gain(c['runs']):.1f} %" for a in ALGORITHMS
             if (c := blob["cells"].get(f"{a} full"))]  # fmt: skip
    lines += ["", "Full fine-tuning's gain over the base (global perplexity, mean over seeds): "
              + ", ".join(gains) + "."]  # fmt: skip
    lines += ["", "Full fine-tuning's global perplexity per seed (the spread behind its CIs):"]
    for a in ALGORITHMS:
        if f"{a} full" in blob["cells"]:
            per_seed = sorted(_by_seed(blob["cells"][f"{a} full"], "global_ppl").items())
            lines.append(f"- {a}: " + ", ".join(f"seed {s} {v:.3f}" for s, v in per_seed))
    return "\n".join(lines)


def load(path: str = os.path.join(RESULTS, FILE)) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def replace_block(text: str, block: str) -> str:
    return readme_block.replace_block(text, BEGIN, END, block)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="write the block into README.md")
    p.add_argument("--file", default=os.path.join(RESULTS, FILE))
    args = p.parse_args()
    readme_block.print_or_write(render(load(args.file)), BEGIN, END, args.write, README)


if __name__ == "__main__":
    main()
