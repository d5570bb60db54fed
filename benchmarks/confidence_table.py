"""Calibration of ``orca_confidence`` on the development suite, before and after: two runs of
``dev_suite.py`` (the uncalibrated softmax: ``--set novelty_folds=0``; calibrated: defaults).

Per task (mean ± sd over seeds): the expected calibration error over known-type query cells
labelled a known type (``ece_known``, the goal: ≤ 0.05), over every query cell labelled a known
type (``ece_labelled_known``: novel-type cells absorbed by a known type are wrong labels too), and
those cells' mean confidence against their accuracy; then how many tasks meet the goal, and
whether the labels of the two runs agree (the calibration must not change them)::

    python benchmarks/dev_suite.py --seeds 0 1 2 --no-large --set novelty_folds=0 \\
        --out reports/suite_conf_before.csv
    python benchmarks/dev_suite.py --seeds 0 1 2 --no-large --out reports/suite_conf_after.csv
    python benchmarks/confidence_table.py reports/suite_conf_before.csv \\
        reports/suite_conf_after.csv > reports/confidence.md
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from orca_sc.benchmark._suite import mean_sd

SAME = ["seen_acc", "novel_acc", "all_acc", "novel_called", "known_called_novel"]


def table(before: pd.DataFrame, after: pd.DataFrame) -> str:
    keys = ["task", "seed"]
    b, a = before.set_index(keys), after.set_index(keys)
    same = np.allclose(
        b[SAME].to_numpy(float), a.loc[b.index, SAME].to_numpy(float), equal_nan=True
    )
    gb, ga = before.groupby("task", sort=False), after.groupby("task", sort=False)
    mb, sb = gb.mean(numeric_only=True), gb.std(ddof=0, numeric_only=True)
    ma, sa = ga.mean(numeric_only=True), ga.std(ddof=0, numeric_only=True)
    lines = [
        "| task | ECE known: before | after | ECE labelled known: before | after | "
        "confidence (after) | accuracy |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in mb.index:
        row = [task]
        for col in ("ece_known", "ece_labelled_known"):
            row += [mean_sd(mb.loc[task, col], sb.loc[task, col]),
                    mean_sd(ma.loc[task, col], sa.loc[task, col])]  # fmt: skip
        row += [mean_sd(ma.loc[task, "confidence_labelled_known"]),
                mean_sd(ma.loc[task, "accuracy_labelled_known"])]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for name, m in (("before", mb), ("after", ma)):
        e = m["ece_known"]
        lines.append(
            f"- {name}: ECE over known-type cells ≤ 0.05 on {int((e <= 0.05).sum())} of "
            f"{int(e.notna().sum())} tasks (median {np.nanmedian(e):.3f}, worst "
            f"{e.idxmax()} {e.max():.3f}); over every cell labelled a known type ≤ 0.05 on "
            f"{int((m['ece_labelled_known'] <= 0.05).sum())}"
        )
    lines.append(f"- labels of every run identical before and after: {same}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(pd.read_csv(sys.argv[1]), pd.read_csv(sys.argv[2])))
