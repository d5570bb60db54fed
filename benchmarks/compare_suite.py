"""Before/after table of two development-suite runs (``benchmarks/dev_suite.py`` CSVs): per task,
seen / novel / all, share of novel-type cells called novel, share of known-type cells called
novel, and novel clusters found (estimated) / true, means over seeds, then the mean over tasks.

Usage: ``python benchmarks/compare_suite.py BEFORE.csv AFTER.csv``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from orca_sc.benchmark import estimate_accuracy

COLS = ["seen_acc", "novel_acc", "all_acc", "novel_called", "known_called_novel"]


def table(before: pd.DataFrame, after: pd.DataFrame) -> str:
    b = before.groupby("task", sort=False)[[*COLS, "novel_found", "novel_est", "novel_true"]]
    a = after.groupby("task", sort=False)[[*COLS, "novel_found", "novel_est", "novel_true"]]
    b, a = b.mean(), a.mean()
    common = a.index.intersection(b.index)
    b, a = b.loc[common], a.loc[common]
    lines = [
        "| task | seen | novel | all | novel->novel | known->novel | found (est) / true |",
        "|---|---|---|---|---|---|---|",
    ]

    def pair(col, task):
        x, y = b.loc[task, col], a.loc[task, col]
        return "–" if pd.isna(x) and pd.isna(y) else f"{x:.3f} → {y:.3f}"

    for task in common:
        found = (
            f"{b.loc[task, 'novel_found']:.1f} ({b.loc[task, 'novel_est']:.1f}) → "
            f"{a.loc[task, 'novel_found']:.1f} ({a.loc[task, 'novel_est']:.1f}) / "
            f"{a.loc[task, 'novel_true']:.0f}"
        )
        lines.append(f"| {task} | " + " | ".join(pair(c, task) for c in COLS) + f" | {found} |")
    mb, ma = b[COLS].mean(), a[COLS].mean()
    lines.append(
        "| **mean over tasks** | " + " | ".join(f"{mb[c]:.3f} → {ma[c]:.3f}" for c in COLS) + " | |"
    )
    for name, runs in (("before", before), ("after", after)):
        acc = estimate_accuracy(runs[runs["task"].isin(common)])
        f = acc["novel_found"]
        lines.append(
            f"\n{name}: clusters found exact in {f['exact']:.0%} of {acc['runs']} runs, "
            f"mean absolute error {f['mae']:.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path, help="dev_suite.py CSV of the old rule")
    ap.add_argument("after", type=Path, help="dev_suite.py CSV of the new rule")
    args = ap.parse_args()
    for p in (args.before, args.after):
        if not p.is_file():
            ap.error(f"{p} is not a file")
    print(table(pd.read_csv(args.before), pd.read_csv(args.after)))
