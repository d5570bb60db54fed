"""Issue 37's check of a change to training on two development-suite runs: per task, the change
of the mean over seeds of seen / novel / all-class accuracy (a drop of more than 1 point fails),
of novel->novel (a drop of more than 2 points fails) and of known->novel (a rise of more than 2
points fails), each with its paired standard error over the seeds (the runs share seeds, so the
splits are the same); and, where the after run has them, the training steps each phase ran.

A failing change is also marked "beyond noise" when it exceeds two paired standard errors.

Usage: ``python benchmarks/drops_table.py BEFORE.csv AFTER.csv [--out reports/drops.md]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from _cli import write_report

#: metric, worse direction (-1: a drop is worse, +1: a rise is worse), allowed change
CHECKS = [
    ("seen_acc", -1, 0.01),
    ("novel_acc", -1, 0.01),
    ("all_acc", -1, 0.01),
    ("novel_called", -1, 0.02),
    ("known_called_novel", +1, 0.02),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--out", type=Path, default=Path("reports/drops.md"))
    args = ap.parse_args()
    b, a = pd.read_csv(args.before), pd.read_csv(args.after)
    m = b.merge(a, on=["task", "seed"], suffixes=("_b", "_a"))
    lines = ["| task | metric | before | after | change | paired SE | beyond noise |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    failing, beyond = set(), set()
    for task, g in m.groupby("task", sort=False):
        for metric, worse, allowed in CHECKS:
            d = (g[f"{metric}_a"] - g[f"{metric}_b"]).dropna()
            if d.empty:
                continue
            change = float(d.mean())
            se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("nan")
            if worse * change > allowed + 1e-12:
                noise = bool(np.isfinite(se) and worse * change > 2 * se)
                failing.add(task)
                if noise:
                    beyond.add(task)
                lines.append(
                    f"| {task} | {metric} | {g[f'{metric}_b'].mean():.3f} | "
                    f"{g[f'{metric}_a'].mean():.3f} | {change:+.3f} | {se:.3f} | "
                    f"{'yes' if noise else 'no'} |"
                )
    n_tasks = m["task"].nunique()
    lines += ["", f"Tasks failing the check: {len(failing)} of {n_tasks}; with a change beyond two "
              f"paired standard errors: {len(beyond)}.", ""]  # fmt: skip
    if "warmup_steps" in a:
        steps = a.groupby("task", sort=False)[[c for c in (
            "warmup_steps", "warmup_max_steps", "open_world_steps", "open_world_max_steps",
            "seconds") if c in a]].mean()  # fmt: skip
        stopped = a.groupby("task", sort=False)["open_world_stopped"].apply(
            lambda s: int((s == "converged").sum())
        )
        lines += ["| task | warm-up steps (schedule) | open-world steps (schedule) | "
                  "open-world runs converged | seconds |", "|---|---|---|---|---|"]  # fmt: skip
        for task, r in steps.iterrows():
            lines.append(
                f"| {task} | {r['warmup_steps']:.0f} ({r['warmup_max_steps']:.0f}) | "
                f"{r['open_world_steps']:.0f} ({r['open_world_max_steps']:.0f}) | "
                f"{stopped[task]} of {int((a['task'] == task).sum())} | {r['seconds']:.1f} |"
            )
        tot = a[["warmup_steps", "open_world_steps"]].sum().sum()
        cap = a[["warmup_max_steps", "open_world_max_steps"]].sum().sum()
        lines += ["", f"Steps run: {tot:.0f} of the schedules' {cap:.0f} ({tot / cap:.0%})."]
    write_report(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
