"""Majority voting against per-cell labels on the development suite, from one run of
``dev_suite.py`` with ``--set majority_vote=True`` (the vote is applied after training, so the
per-cell labels of that run are those of a run without it, same seed).

Per task (mean ± sd over seeds), per-cell → voted: all-class and seen accuracy, novel-type
cells called novel, known-type cells called novel, novel clusters found (true count beside);
then the share of query cells in mixed clusters and how many tasks gain or lose more than one
point of all-class accuracy::

    python benchmarks/dev_suite.py --seeds 0 1 2 --no-large --set majority_vote=True \\
        --out reports/suite_vote.csv
    python benchmarks/majority_vote_table.py reports/suite_vote.csv > reports/majority_vote.md
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from orca_sc.benchmark._suite import mean_sd

FIGURES = [
    ("all_acc", "all"),
    ("seen_acc", "seen"),
    ("novel_called", "novel→novel"),
    ("known_called_novel", "known→novel"),
    ("novel_found", "found"),
]


def table(runs: pd.DataFrame) -> str:
    g = runs.groupby("task", sort=False)
    m, s = g.mean(numeric_only=True), g.std(ddof=0, numeric_only=True)
    head = " | ".join(f"{name}: per cell | voted" for _, name in FIGURES)
    lines = [
        f"| task | {head} | true | mixed |",
        "|---|" + "---|---|" * len(FIGURES) + "---|---|",
    ]
    for task in m.index:
        row = [task]
        for col, _ in FIGURES:
            row += [mean_sd(m.loc[task, f"per_cell_{col}"], s.loc[task, f"per_cell_{col}"]),
                    mean_sd(m.loc[task, col], s.loc[task, col])]  # fmt: skip
        row += [f"{m.loc[task, 'novel_true']:.0f}", f"{m.loc[task, 'vote_mixed_share']:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for col, name in FIGURES[:4]:
        d = m[col] - m[f"per_cell_{col}"]
        if col == "known_called_novel":
            d = -d  # fewer known-type cells called novel is better
        lines.append(
            f"- {name}: better by > 0.01 on {int((d > 0.01).sum())} tasks, worse by > 0.01 on "
            f"{int((d < -0.01).sum())} of {int(d.notna().sum())} (mean change "
            f"{np.nanmean(m[col] - m[f'per_cell_{col}']):+.4f}; worst "
            f"{d.idxmin()} {d.min():+.3f})"
        )
    exact = (runs["novel_found"] == runs["novel_true"]).mean()
    exact_pc = (runs["per_cell_novel_found"] == runs["novel_true"]).mean()
    lines.append(f"- found = true: per cell {exact_pc:.0%} of runs, voted {exact:.0%}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(pd.read_csv(sys.argv[1])))
