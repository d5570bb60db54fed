"""Open-world benchmark: the paper's protocol and cross-batch splits, ORCA, its ablations and
baselines, time and memory, scaling, and a Markdown/CSV/plot report (``orca-sc benchmark``).
"""

from ._methods import DEFAULT_METHODS, METHODS, QUICK_METHODS, Method, MethodUnavailable
from ._report import markdown, write_report
from ._run import BenchmarkResult, PeakMemory, run_benchmark, score, summarize_runs
from ._scaling import flops_per_cell_epoch, matmul_gflops, run_scaling
from ._splits import Task, batch_split, protocol_split
from ._tasks import TaskSpec, builtin_tasks

__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "QUICK_METHODS",
    "BenchmarkResult",
    "Method",
    "MethodUnavailable",
    "PeakMemory",
    "Task",
    "TaskSpec",
    "batch_split",
    "builtin_tasks",
    "flops_per_cell_epoch",
    "markdown",
    "matmul_gflops",
    "protocol_split",
    "run_benchmark",
    "run_scaling",
    "score",
    "summarize_runs",
    "write_report",
]
