"""The novelty test on the development suite, from the suite's runs (``dev_suite.py --out``).

Per task (mean ± sd over seeds): the share of known-type query cells with a novelty p-value at
most alpha (the test's level: at most alpha where reference and query cells of a type are
alike), the share of novel-type cells (its power), and novel->novel / known->novel under three
rules: the annotation as it is (``labels``), per-cell Benjamini-Hochberg calls (``bh``: q <=
alpha) and the cluster vote (``vote``: novel clusters less those the test finds not unlike the
reference). Then how many tasks meet the goals under each rule::

    python benchmarks/dev_suite.py --seeds 0 1 2 --no-large --out reports/suite.csv
    python benchmarks/novelty_rules.py reports/suite.csv > reports/novelty_rules.md
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from orca_sc.benchmark._suite import mean_sd as _cell

RULES = {
    "labels": ("novel_called", "known_called_novel"),
    "bh": ("novel_bh_called", "known_bh_called"),
    "vote": ("novel_vote_called", "known_vote_called"),
}


def table(runs: pd.DataFrame) -> str:
    runs = runs[runs["method"] == "ORCA"]
    g = runs.groupby("task", sort=False)
    mean, sd = g.mean(numeric_only=True), g.std(ddof=0, numeric_only=True)
    head = "| task | p <= a: known | p <= a: novel | " + " | ".join(
        f"{r}: novel->novel | {r}: known->novel" for r in RULES
    )
    lines = [head + " |", "|---" * (3 + 2 * len(RULES)) + "|"]
    meets = {r: [0, 0, 0] for r in RULES}
    for task, m in mean.iterrows():
        s = sd.loc[task]
        row = [task, _cell(m["known_p_below_alpha"], s["known_p_below_alpha"]),
               _cell(m["novel_p_below_alpha"])]  # fmt: skip
        for r, (nov, kno) in RULES.items():
            row += [_cell(m[nov], s[nov]), _cell(m[kno], s[kno])]
            meets[r][0] += bool(m[nov] >= 0.9) if pd.notna(m[nov]) else 0
            meets[r][1] += bool(m[kno] <= 0.05)
            meets[r][2] += int(pd.notna(m[nov]))
        lines.append("| " + " | ".join(row) + " |")
    n = len(mean)
    lines += ["", "Tasks meeting the goals:", ""]
    for r, (a, b, n_nov) in meets.items():
        lines.append(
            f"- {r}: novel->novel >= 0.9 on {a} of {n_nov}; known->novel <= 0.05 on {b} of {n}"
        )
    level = mean["known_p_below_alpha"]
    lines.append(
        f"- level: known-type cells with p <= alpha, median over tasks {np.nanmedian(level):.3f}; "
        f"at most 0.05 on {int((level <= 0.05).sum())} of {int(level.notna().sum())} tasks"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(pd.read_csv(sys.argv[1])), end="")
