"""How often each evidence level of the novel clusters (``uns['orca']['novel_evidence']``) is a
false call, from a development-suite run of ``benchmarks/dev_suite.py``.

Usage: ``python benchmarks/evidence_table.py reports/dev_suite.csv``. Prints one row per level:
clusters, clusters that are mostly cells of known types (false calls), cells, and the share of
their cells that are of novel types; and the same per task kind.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

LEVELS = ("supported", "cannot_tell", "not_confirmed", "not_tested")


def table(runs: pd.DataFrame) -> str:
    lines = [
        "| evidence | clusters | mostly known-type cells | cells | share of novel-type cells |",
        "|---|---|---|---|---|",
    ]
    for level in LEVELS:
        cols = [f"ev_{level}_{k}" for k in ("clusters", "false", "cells", "novel_cells")]
        if cols[0] not in runs:
            continue
        n, false, cells, novel = (int(runs[c].sum()) for c in cols)
        share = f"{novel / cells:.3f}" if cells else "–"
        frac = f"{false} ({false / n:.0%})" if n else "0"
        lines.append(f"| {level.replace('_', ' ')} | {n} | {frac} | {cells:,} | {share} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", type=Path)
    args = ap.parse_args()
    runs = pd.read_csv(args.runs)
    print(f"All {runs['task'].nunique()} tasks, {len(runs)} runs\n")
    print(table(runs))
    for kind, sub in runs.groupby("kind"):
        print(f"\n{kind} ({sub['task'].nunique()} tasks)\n")
        print(table(sub))


if __name__ == "__main__":
    main()
