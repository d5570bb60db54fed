"""Before/after table of two development-suite runs against issue 34's goals: per task, seen /
novel / all accuracy, novel->novel (share of novel-type cells called novel), known->novel, the
share of runs whose number of novel clusters is right, and seconds, each as the mean over seeds
with its seed sd; then how many tasks meet each goal before and after.

Goals: novel->novel >= 0.9, known->novel <= 0.05, novel clusters right in >= 70% of runs, seed sd
of novel->novel and known->novel <= 0.05, all-class accuracy no more than 2 points below before.

Usage: ``python benchmarks/goals_table.py BEFORE.csv AFTER.csv [--before-prefix per_cell_]
[--out reports/goals.md]``. ``--before-prefix per_cell_`` reads the before run's per-cell
columns (a run with ``majority_vote=True`` keeps the unvoted labels there).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

METRICS = ["seen_acc", "novel_acc", "all_acc", "novel_called", "known_called_novel", "novel_found"]


def _load(path: Path, prefix: str) -> pd.DataFrame:
    df = pd.read_csv(path)
    df = df[df["method"] == "ORCA"].copy()
    for m in METRICS:
        if prefix and f"{prefix}{m}" in df:
            df[m] = df[f"{prefix}{m}"]
    df["exact"] = (df["novel_found"] == df["novel_true"]).astype(float)
    return df


def _per_task(df: pd.DataFrame) -> pd.DataFrame:
    g = df.groupby("task", sort=False)
    out = g[[*METRICS, "exact", "seconds", "novel_true"]].mean()
    sd = g[["novel_called", "known_called_novel", "all_acc"]].std(ddof=0)
    return out.join(sd, rsuffix="_sd")


def _cell(b: float, a: float, bsd: float | None = None, asd: float | None = None) -> str:
    if np.isnan(a) and np.isnan(b):
        return "–"
    sd = lambda s: "" if s is None or np.isnan(s) or s < 5e-4 else f" ± {s:.2f}"  # noqa: E731
    return f"{b:.3f}{sd(bsd)} → {a:.3f}{sd(asd)}"


def goals(t: pd.DataFrame, base: pd.DataFrame) -> dict[str, str]:
    nn = t["novel_called"].dropna()
    stable = (t["novel_called_sd"].fillna(0) <= 0.05) & (t["known_called_novel_sd"] <= 0.05)
    drop = (t["all_acc"] < base.loc[t.index, "all_acc"] - 0.02).sum()
    return {
        "novel->novel >= 0.9": f"{(nn >= 0.9).sum()} of {nn.size}",
        "known->novel <= 0.05": f"{(t['known_called_novel'] <= 0.05).sum()} of {len(t)}",
        "clusters right in >= 70% of runs": f"{(t['exact'] >= 0.7).sum()} of {len(t)}",
        "runs with clusters right": f"{t['exact'].mean():.0%}",
        "seed sd of both <= 0.05": f"{stable.sum()} of {len(t)}",
        "all-class accuracy > 2 points below before": f"{drop} of {len(t)}",
    }


def table(before: pd.DataFrame, after: pd.DataFrame) -> str:
    b, a = _per_task(before), _per_task(after)
    common = [t for t in a.index if t in b.index]
    b, a = b.loc[common], a.loc[common]
    lines = [
        "| task | seen | novel | all | novel->novel | known->novel | found / true (runs right) "
        "| seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in common:
        x, y = b.loc[t], a.loc[t]
        found = (
            f"{x.novel_found:.1f} ({x.exact:.0%}) → {y.novel_found:.1f} ({y.exact:.0%}) "
            f"/ {y.novel_true:.0f}"
        )
        lines.append(
            f"| {t} | {_cell(x.seen_acc, y.seen_acc)} | {_cell(x.novel_acc, y.novel_acc)} "
            f"| {_cell(x.all_acc, y.all_acc, x.all_acc_sd, y.all_acc_sd)} "
            f"| {_cell(x.novel_called, y.novel_called, x.novel_called_sd, y.novel_called_sd)} "
            f"| {_cell(x.known_called_novel, y.known_called_novel, x.known_called_novel_sd, y.known_called_novel_sd)} "
            f"| {found} | {x.seconds:.1f} → {y.seconds:.1f} |"
        )
    gb, ga = goals(b, b), goals(a, b)
    lines += ["", "| goal | before | after |", "|---|---|---|"]
    lines += [f"| {k} | {gb[k]} | {ga[k]} |" for k in gb]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--before-prefix", default="")
    ap.add_argument("--after-prefix", default="")
    ap.add_argument("--out", type=Path, default=Path("reports/goals.md"))
    args = ap.parse_args()
    md = table(_load(args.before, args.before_prefix), _load(args.after, args.after_prefix))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
