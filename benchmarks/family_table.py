"""ORCA against the ceiling per dataset family and task, on the suite's real tasks.

    python benchmarks/family_table.py ORCA_RUNS.csv CEILING_RUNS.csv [--out table.md]

Both are ``runs.csv`` of ``orca-sc benchmark --suite dev`` with the same tasks and seeds
(``--method ORCA`` and ``--method "Supervised reference (query labels, CV)"``). Prints, per
family and task (means ± seed sd): novel→novel, known→novel, novel clusters found / true and
all-class accuracy of both, whether the ceiling meets each detection goal (*feasible*) and
ORCA's goal counts on the feasible tasks. The simulations are left out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from orca_sc.benchmark._compare import family_verdict, feasible, orca_runs
from orca_sc.benchmark._suite_table import REFERENCE, meets_goal
from orca_sc.benchmark._tasks import dataset_family, real_family


def table(orca: pd.DataFrame, ceiling: pd.DataFrame) -> str:
    cols = ["novel_called", "known_called_novel", "novel_found", "novel_true", "all_acc"]
    runs = orca_runs(orca)
    o = runs.groupby("task")[cols]
    om, osd = o.mean(), o.std(ddof=0)
    cm = orca_runs(ceiling, method=REFERENCE).groupby("task")[cols].mean()
    tasks = [t for t in om.index if t in cm.index and real_family(t)]
    # a goal the ceiling meets and ORCA misses (a task without novel types has no novel goal)
    ok = feasible(cm.loc[tasks])
    miss = {g: ok[g] & ~meets_goal(g, om.loc[tasks, g].fillna(0)) for g in ok.columns}
    seeds = sorted(runs["seed"].unique())
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; ORCA ± seed sd / ceiling; **bold**: a goal the "
        "ceiling meets and ORCA misses.",
        "",
        "| family | task | novel→novel | known→novel | clusters ORCA / ceiling / true | all-class |",
        "|---|---|---|---|---|---|",
    ]
    for t in sorted(tasks, key=lambda t: (dataset_family(t), t)):
        a, s, r = om.loc[t], osd.loc[t], cm.loc[t]
        cell = {g: "–" if pd.isna(a[g]) else f"{a[g]:.3f} ± {s[g]:.2f} / {r[g]:.3f}" for g in ok}
        cell = {g: f"**{v}**" if miss[g][t] else v for g, v in cell.items()}
        lines.append(
            f"| {dataset_family(t)} | {t} | {cell['novel_called']} "
            f"| {cell['known_called_novel']} "
            f"| {a.novel_found:.1f} / {r.novel_found:.1f} / {a.novel_true:.0f} "
            f"| {a.all_acc:.3f} / {r.all_acc:.3f} |"
        )
    # the goals ORCA meets on the feasible tasks of each family, as compare --ceiling counts them
    fam = family_verdict(om.loc[tasks], om.loc[tasks], cm.loc[tasks]).table
    lines += ["", "| family | novel→novel met on feasible | known→novel met on feasible |",
              "|---|---|---|"]  # fmt: skip
    lines += [
        f"| {f} | {r['novel_called_after']:.0f} of {r['novel_called_feasible']:.0f} "
        f"| {r['known_called_novel_after']:.0f} of {r['known_called_novel_feasible']:.0f} |"
        for f, r in [*fam.iterrows(), ("all real", fam.sum())]
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("orca")
    p.add_argument("ceiling")
    p.add_argument("--out")
    a = p.parse_args()
    md = table(pd.read_csv(a.orca), pd.read_csv(a.ceiling))
    if a.out:
        Path(a.out).write_text(md)
    print(md)


if __name__ == "__main__":
    main()
