"""Open-world benchmark: the paper's protocol and cross-batch splits, ORCA, its ablations and
baselines, time and memory, scaling, and a Markdown/CSV/plot report (``orca-sc benchmark``).
"""

from .._ablation import Ablation, DiscoveryRules
from ._compare import Comparison, compare_columns, compare_runs, orca_runs
from ._devsuite import config_overrides, orca_row, run_orca_suite
from ._hooks import Callback, StageCensus, StageTimer, StopTrace, observe
from ._integration import integration_figures
from ._methods import (
    DEFAULT_METHODS,
    METHODS,
    QUICK_METHODS,
    SUITE_METHODS,
    Method,
    MethodUnavailable,
    annotate_task,
    confidence_figures,
    novelty_test_shares,
)
from ._report import markdown, write_report, write_scaling
from ._run import BenchmarkResult, PeakMemory, run_benchmark, score, summarize_runs
from ._scaling import (
    epoch_speed,
    flops_per_cell_epoch,
    matmul_gflops,
    run_scaling,
    simulated_open_world,
    training_columns,
)
from ._splits import Task, batch_split, grow_task, protocol_split
from ._suite import (
    SimSetting,
    dev_suite,
    grown_tasks,
    make_sim_task,
    scale_settings,
    select_tasks,
    sim_settings,
)
from ._suite_table import estimate_accuracy, suite_markdown, suite_table
from ._tasks import TaskSpec, builtin_tasks, reversed_tasks

__all__ = [
    "Ablation",
    "DiscoveryRules",
    "Comparison",
    "compare_columns",
    "compare_runs",
    "config_overrides",
    "confidence_figures",
    "novelty_test_shares",
    "orca_row",
    "orca_runs",
    "run_orca_suite",
    "Callback",
    "StageCensus",
    "StageTimer",
    "StopTrace",
    "observe",
    "DEFAULT_METHODS",
    "METHODS",
    "QUICK_METHODS",
    "SUITE_METHODS",
    "BenchmarkResult",
    "Method",
    "MethodUnavailable",
    "PeakMemory",
    "SimSetting",
    "Task",
    "TaskSpec",
    "annotate_task",
    "batch_split",
    "grow_task",
    "integration_figures",
    "grown_tasks",
    "builtin_tasks",
    "dev_suite",
    "estimate_accuracy",
    "make_sim_task",
    "reversed_tasks",
    "scale_settings",
    "select_tasks",
    "sim_settings",
    "suite_markdown",
    "suite_table",
    "training_columns",
    "epoch_speed",
    "flops_per_cell_epoch",
    "markdown",
    "matmul_gflops",
    "protocol_split",
    "run_benchmark",
    "run_scaling",
    "score",
    "simulated_open_world",
    "summarize_runs",
    "write_report",
    "write_scaling",
]
