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

from orca_sc.benchmark._compare import feasible, orca_runs
from orca_sc.benchmark._suite_table import REFERENCE, meets_goal
from orca_sc.benchmark._tasks import dataset_family


def _mean_sd(g, col):
    m, s = g[col].mean(), g[col].std(ddof=0)
    return m, s


def table(orca: pd.DataFrame, ceiling: pd.DataFrame) -> str:
    o = orca_runs(orca)
    c = orca_runs(ceiling, method=REFERENCE)
    cols = ["novel_called", "known_called_novel", "novel_found", "novel_true", "all_acc"]
    om, osd = o.groupby("task")[cols].mean(), o.groupby("task")[cols].std(ddof=0)
    cm = c.groupby("task")[cols].mean()
    tasks = [t for t in om.index if t in cm.index and dataset_family(t) != "simulated"]
    ok = feasible(cm.loc[tasks])
    fam = pd.Series({t: dataset_family(t) for t in tasks})
    seeds = sorted(o["seed"].unique())
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; ORCA ± seed sd / ceiling; **bold**: a goal the "
        "ceiling meets and ORCA misses.",
        "",
        "| family | task | novel→novel | known→novel | clusters ORCA / ceiling / true | all-class |",
        "|---|---|---|---|---|---|",
    ]
    counts = []
    for family, ts in fam.groupby(fam).groups.items():
        n_nn = n_kn = f_nn = f_kn = 0
        for t in sorted(ts):
            a, s, r = om.loc[t], osd.loc[t], cm.loc[t]
            miss_nn = bool(ok.loc[t, "novel_called"]) and not meets_goal(
                "novel_called", pd.Series([a.novel_called])
            ).iloc[0]
            miss_kn = bool(ok.loc[t, "known_called_novel"]) and not meets_goal(
                "known_called_novel", pd.Series([a.known_called_novel])
            ).iloc[0]
            nn = "–" if pd.isna(a.novel_called) else (
                f"{a.novel_called:.3f} ± {s.novel_called:.2f} / {r.novel_called:.3f}")  # fmt: skip
            kn = f"{a.known_called_novel:.3f} ± {s.known_called_novel:.2f} / {r.known_called_novel:.3f}"
            lines.append(
                f"| {family} | {t} | {'**' + nn + '**' if miss_nn else nn} "
                f"| {'**' + kn + '**' if miss_kn else kn} "
                f"| {a.novel_found:.1f} / {r.novel_found:.1f} / {a.novel_true:.0f} "
                f"| {a.all_acc:.3f} / {r.all_acc:.3f} |"
            )
            f_nn += bool(ok.loc[t, "novel_called"])
            f_kn += bool(ok.loc[t, "known_called_novel"])
            n_nn += bool(ok.loc[t, "novel_called"]) and not miss_nn
            n_kn += bool(ok.loc[t, "known_called_novel"]) and not miss_kn
        counts.append((family, n_nn, f_nn, n_kn, f_kn))
    lines += ["", "| family | novel→novel met on feasible | known→novel met on feasible |",
              "|---|---|---|"]  # fmt: skip
    lines += [f"| {f} | {a} of {b} | {c_} of {d} |" for f, a, b, c_, d in counts]
    tot = [sum(x[i] for x in counts) for i in range(1, 5)]
    lines.append(f"| all real | {tot[0]} of {tot[1]} | {tot[2]} of {tot[3]} |")
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
