"""What the stopping rule sees: every check of every phase of training on development-suite
tasks, run to the end of the schedule (nothing stops), so that tolerances can be compared.

Usage: ``python benchmarks/stop_trace.py [--only NAME ...] [--seeds 0] [--out reports/stop_trace.csv]``

For each check: the task, seed, phase, step, the share of the sampled cells whose head changed
since the last check, the loss's fall over the last window and two standard errors of it, and
whether the rule would stop there. Then, per phase, the step at which it would have stopped
with the default minimum of 100 steps (checks from step 25 on: ``stop_min_steps=0``).
"""

from __future__ import annotations

import warnings

import pandas as pd
from _cli import task_parser

from orca_sc.benchmark import StopTrace, annotate_task, dev_suite, observe


def main() -> None:
    args = task_parser(__doc__, "reports/stop_trace.csv").parse_args()
    rows: list[dict] = []
    data = args.data if args.data.is_dir() else None
    for spec in dev_suite(data, large=False, only=args.only):
        for seed in args.seeds:
            task = spec.make(seed)
            trace = StopTrace(run_schedule=True, task=spec.name, seed=seed)
            with warnings.catch_warnings(), observe(trace):
                warnings.simplefilter("ignore")
                annotate_task(task, seed, stop_min_steps=0)
            rows += trace.rows
            print(spec.name, seed, len(rows), flush=True)
    trace = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    trace.to_csv(args.out, index=False)
    summary = []
    for (t, s, ph), g in trace.groupby(["task", "seed", "phase"], sort=False):
        ok = g.would_stop & (g.step >= 100)  # the rule at the default minimum of 100 steps
        summary.append(
            {
                "task": t,
                "seed": s,
                "phase": ph,
                "max": int(g.step.max()),
                "stop": int(g.step[ok].iloc[0]) if ok.any() else int(g.step.max()),
            }
        )
    print(pd.DataFrame(summary).to_string(index=False))


if __name__ == "__main__":
    main()
