"""The rule-by-rule ablation of discovery: which real dataset families need each rule.

    python benchmarks/rule_ablation.py DEFAULTS.csv CEILING.csv NAME=RUNS.csv ... [--out F.md]

``DEFAULTS.csv``: ``runs.csv`` of ``orca-sc benchmark --suite dev --method ORCA`` with the
defaults; each ``NAME=RUNS.csv`` the same tasks and seeds (or those the rule can act on) with
one rule switched off (``--set drop=NAME``, ``--set anchor_epochs=0``, ...); ``CEILING.csv`` the
supervised reference's runs, or ``none``: every task counted as feasible (the large tier,
which has no ceiling runs). With ``--simulated`` (and ``none`` for the ceiling) the simulations
are judged instead, as one family. Prints, per
rule, the families that need it (:func:`orca_sc.benchmark._compare.rule_need`: without it,
fewer detection goals met on their feasible tasks, a task's all-class accuracy more than 2
points lower, or a detection figure worse by more than 2 points beyond noise), the families
that gain without it, and per family the goals with / without and the tasks lower / higher /
worse / better; then per rule and task the figures that moved.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from orca_sc.benchmark._compare import _per_task, orca_runs, rule_need
from orca_sc.benchmark._suite_table import REFERENCE
from orca_sc.benchmark._tasks import real_family

MOVED = ["novel_called", "known_called_novel", "novel_found", "all_acc"]


def report(
    defaults: pd.DataFrame,
    ceiling: pd.DataFrame | None,
    ablations: dict[str, pd.DataFrame],
    simulated: bool = False,
):
    base_runs = orca_runs(defaults)
    base = _per_task(base_runs)
    if ceiling is None:  # every task feasible: a ceiling that meets both goals
        ceil = base.assign(novel_called=base["novel_called"].notna().astype(float),
                           known_called_novel=0.0)  # fmt: skip
    else:
        ceil = _per_task(orca_runs(ceiling, method=REFERENCE))
    seeds = sorted(base_runs["seed"].unique())
    scope = "the simulations only" if simulated else "real tasks only"
    if ceiling is None:
        scope += ", every task counted as feasible"
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; {scope}. Goals: detection goals met on the tasks "
        "where the ceiling meets them; lower / higher: tasks whose all-class accuracy "
        "is more than 2 points lower / higher without the rule; worse / better: tasks whose "
        "novel→novel falls or known→novel rises (worse) by more than 2 points and two paired "
        "standard errors without it.",
        "",
        "| rule switched off | tasks | goals with → without | lower | higher | worse | better "
        "| needed by | gains without it | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    detail: list[str] = []
    for name, runs in ablations.items():
        off_runs = orca_runs(runs)
        off = _per_task(off_runs)
        need = rule_need(base_runs, off_runs, ceil, simulated=simulated)
        t = need.table
        if t.empty:
            kind = "simulated" if simulated else "real"
            msg = f"{name}: no {kind} task is in both the defaults' and the ablation's runs."
            raise SystemExit(msg)
        tot = t.sum()
        lines.append(
            f"| {name} | {int(tot['tasks'])} | {int(tot['goals_with'])} → "
            f"{int(tot['goals_without'])} | {int(tot['lower'])} | {int(tot['higher'])} "
            f"| {int(tot['worse'])} | {int(tot['better'])} "
            f"| {', '.join(need.needed_by) or '–'} | {', '.join(need.gains_without) or '–'} "
            f"| {'goes' if need.goes else 'stays'} |"
        )
        detail += [f"### {name}", "",
                   "| family | tasks | goals with → without | lower | higher | worse | better |",
                   "|---|---|---|---|---|---|---|"]  # fmt: skip
        detail += [
            f"| {f} | {r['tasks']:.0f} | {r['goals_with']:.0f} → {r['goals_without']:.0f} "
            f"| {r['lower']:.0f} | {r['higher']:.0f} | {r['worse']:.0f} | {r['better']:.0f} |"
            for f, r in t.iterrows()
        ]
        common = [
            x for x in off.index
            if x in base.index and real_family(x) != simulated
        ]  # fmt: skip
        moved = [
            x for x in common
            if (base.loc[x, MOVED] - off.loc[x, MOVED]).abs().fillna(0).max() > 5e-4
        ]  # fmt: skip
        detail += ["", f"Tasks that moved: {len(moved)} of {len(common)}.", ""]
        if moved:
            detail += ["| task | novel→novel | known→novel | clusters | all-class |",
                       "|---|---|---|---|---|"]  # fmt: skip
            for x in moved:
                b, a = base.loc[x], off.loc[x]
                nn = (
                    "–"
                    if pd.isna(b.novel_called)
                    else f"{b.novel_called:.3f} → {a.novel_called:.3f}"
                )
                detail.append(
                    f"| {x} | {nn} | {b.known_called_novel:.3f} → {a.known_called_novel:.3f} "
                    f"| {b.novel_found:.1f} → {a.novel_found:.1f} | {b.all_acc:.3f} → "
                    f"{a.all_acc:.3f} |"
                )
            detail.append("")
    return "\n".join([*lines, "", *detail]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("defaults", type=Path)
    p.add_argument("ceiling", help="the ceiling's runs.csv, or 'none' (every task feasible)")
    p.add_argument("ablations", nargs="+", help="NAME=RUNS.csv")
    p.add_argument("--out", type=Path)
    p.add_argument("--simulated", action="store_true",
                   help="judge the simulations (one family, every task feasible) instead")  # fmt: skip
    args = p.parse_args()
    abl = {}
    for item in args.ablations:
        name, _, path = item.partition("=")
        abl[name] = pd.read_csv(path)
    ceiling = None if args.ceiling == "none" else pd.read_csv(args.ceiling)
    text = report(pd.read_csv(args.defaults), ceiling, abl, simulated=args.simulated)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
