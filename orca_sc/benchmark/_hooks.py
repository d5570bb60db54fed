"""Hooks that watch a run without changing it (:func:`orca_sc._engine.observe`): seconds per
stage of the pipeline, every check of the training's stopping rule, and where each cell's
novel call is made (discovery, the open-world fit, the naming).

Used as::

    from orca_sc.benchmark import StageTimer, StopTrace, observe

    with observe(StageTimer()) as (timer,):
        orca_sc.tl.annotate(query, reference, labels_key="cell_type")
    print(timer.seconds)
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from .._engine import Callback, StopState, observe

__all__ = ["Callback", "StageCensus", "StageTimer", "StopTrace", "observe"]


class StageTimer(Callback):
    """Seconds of each stage of the pipeline (``seconds``, summed over the calls of a stage:
    the five fold warm-ups count as one entry) and of each phase of training (``phases``:
    ``"warm-up"``, ``"open-world"``; every warm-up of a run, the side ones included), and how
    often each ran (``calls``). Stages nest (:attr:`NESTED`): ``"fold warm-ups"`` is part of
    ``"cross-fitted warm-ups"``, ``"fold inference"`` and ``"fold scores"`` of
    ``"novelty test (cross-fit)"``, ``"integration"`` of ``"discovery"``, ``"margin refresh"``
    of the phase it runs in.
    """

    #: stages that run inside another one: their seconds are already in that stage's
    NESTED = ("margin refresh", "fold warm-ups", "fold inference", "fold scores", "integration")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.phases: dict[str, float] = collections.defaultdict(float)

    def on_stage_end(self, stage: str, seconds: float) -> None:
        self.seconds[stage] += seconds
        self.calls[stage] += 1

    def on_epoch_end(self, phase: str, net: Any, record: dict) -> None:
        self.phases[phase] += float(record.get("seconds", 0.0))

    def outer_seconds(self) -> float:
        """Seconds of the stages that run inside no other (each second counted once)."""
        return sum(v for k, v in self.seconds.items() if k not in self.NESTED)


class StopTrace(Callback):
    """Every check of the stopping rule in every phase: its step, the share of the sampled
    cells whose head changed, the loss's fall over the last window and two standard errors of
    it, and the rule's verdict (``rows``, one dict per check; ``context`` is copied into each).
    With ``run_schedule`` the phases never stop, so that the rule can be traced to the end of
    the schedule.
    """

    def __init__(self, run_schedule: bool = False, **context: Any) -> None:
        self.run_schedule = run_schedule
        self.context = dict(context)
        self.rows: list[dict] = []
        self._phase_no = 0

    def on_phase_start(self, phase: str, net: Any) -> None:
        self._phase_no += 1

    def on_check(self, phase: str, state: StopState, stop: bool) -> bool:
        self.rows.append(
            {**self.context, "phase": f"{self._phase_no}:{phase}", "step": state.steps,
             "changed": state.changed, "loss_fall": state.loss_fall,
             "loss_noise": state.loss_noise, "would_stop": stop}
        )  # fmt: skip
        return self.run_schedule


class StageCensus(Callback):
    """Where each cell of a run is called novel: in one of discovery's candidate clusters
    (``candidate``, each cell's candidate, ``-1`` for none), on a novel head after the
    open-world fit (``head``, each cell's head; ``n_seen`` seen heads first), and whether the
    naming then reported that head as a known type (``merged_into_known``) or pruned it
    (``pruned``; novel head numbers). Rows are the run's cells (the reference's labelled cells
    first, then each query's, for a separate query; the AnnData's order for one AnnData).
    """

    def __init__(self) -> None:
        self.candidate: np.ndarray | None = None
        self.head: np.ndarray | None = None
        self.n_seen = 0
        self.merged_into_known: list[int] = []
        self.pruned: list[int] = []

    def on_result(self, name: str, result: Any) -> None:
        if name == "candidates":
            self.candidate = np.asarray(result)
        elif name == "heads":
            self.head = np.asarray(result["head"])
            self.n_seen = int(result["n_seen"])
            self.merged_into_known = list(result["merged_into_known"])
            self.pruned = list(result["pruned"])

    def stages(self, rows: np.ndarray | slice) -> dict[str, np.ndarray]:
        """For the run's cells ``rows``: ``in_candidate``, ``novel_after_fit`` (a novel head
        after the fit) and ``named_known`` (that head reported as a known type by the naming).
        """
        if self.candidate is None or self.head is None:
            msg = "no run was observed: annotate inside `with observe(census)`"
            raise RuntimeError(msg)
        head = self.head[rows]
        novel = head >= self.n_seen
        merged = np.isin(head - self.n_seen, self.merged_into_known) & novel
        return {"in_candidate": self.candidate[rows] >= 0, "novel_after_fit": novel,
                "named_known": merged}  # fmt: skip
