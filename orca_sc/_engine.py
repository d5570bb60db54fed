"""The one training loop of orca_sc, and the hooks that watch a run.

:func:`fit_phase` trains a net for a range of epochs: every net a run trains goes through it
(the supervised warm-up, the open-world fit, the cross-fitted fold warm-ups, the self-check,
the size check's sample, and :mod:`orca_sc.vision`'s ORCA and SimCLR runs). What differs
between them is held by three objects it is given:

* a **batch source** (:class:`BatchSource`): the mini-batches of an epoch (index arrays, drawn
  from the run's random streams) and the inputs of each, loaded a stretch at a time;
* a **loss** (:class:`PhaseLoss`): the named loss terms of a batch (the first is optimised),
  with the state it keeps between epochs (ORCA's margin from the unlabelled cells'
  uncertainty, refreshed at the start of every epoch; the regulariser's prior; anchors);
* an optional **stopping state** (:class:`StopState`): when a phase ends before its schedule.

Several processes train together inside a step: a batch item that carries a ``shard``
(:class:`orca_sc._dist.BatchShard`) is run under :func:`orca_sc._dist.sharded`, and the layers
that need the whole batch (BatchNorm, dropout) read it there; no forward takes it.

**Hooks.** A :class:`Callback` sees each phase start and end, each epoch's record and each
check of the stopping rule. Callbacks are given to :func:`fit_phase`, or installed around any
code with :func:`observe` (then they also see the pipeline's stages, :func:`stage`, and what
some stages decide, :func:`publish`): that is how the benchmarks time the stages, trace the
stopping rule and follow the cells through discovery, the fit and the naming without patching
anything.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ._ambient import ambient, current
from ._dist import sharded
from ._errors import TrainingDivergedError

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ hooks
class Callback:
    """What a hook may watch; every method does nothing unless overridden. ``phase`` is the
    phase's name (``"warm-up"``, ``"open-world"``, ``"orca (images)"``, ``"simclr"``).
    """

    def on_phase_start(self, phase: str, net: torch.nn.Module) -> None:
        """A phase starts training ``net``."""

    def on_epoch_end(self, phase: str, net: torch.nn.Module, record: dict) -> None:
        """An epoch ended; ``record`` (already in the history) may be added to."""

    def on_check(self, phase: str, state: StopState, stop: bool) -> bool | None:
        """A check of the stopping rule; ``stop``: its verdict. Return ``True`` to keep the
        phase going whatever the verdict (to trace the rule over a whole schedule).
        """

    def on_phase_end(self, phase: str, net: torch.nn.Module, history: list[dict]) -> None:
        """A phase ended (``history``: its records)."""

    def on_stage_start(self, stage: str) -> None:
        """A stage of the pipeline starts (only for callbacks installed with :func:`observe`)."""

    def on_stage_end(self, stage: str, seconds: float) -> None:
        """A stage of the pipeline ended after ``seconds``."""

    def on_result(self, name: str, result: Any) -> None:
        """A stage of the pipeline decided ``result`` (only for callbacks installed with
        :func:`observe`): ``"candidates"`` (discovery's candidate novel cluster of every cell of
        the run, ``-1`` for none) and ``"heads"`` (each cell's head after the open-world fit,
        before the naming, with the novel heads the naming reported as known types and those
        it pruned). Read only; the run does not depend on it.
        """


@contextlib.contextmanager
def observe(*callbacks: Callback) -> Iterator[tuple[Callback, ...]]:
    """Install ``callbacks`` on every phase and stage run inside the ``with`` block."""
    with ambient(observers=(*current().observers, *callbacks)):
        yield callbacks


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Mark a stage of the pipeline for the installed observers (nothing without one)."""
    observers = current().observers
    if not observers:
        yield
        return
    for cb in observers:
        cb.on_stage_start(name)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - t0
        for cb in observers:
            cb.on_stage_end(name, seconds)


def publish(name: str, make: Callable[[], Any]) -> None:
    """Give the installed observers what a stage decided (:meth:`Callback.on_result`);
    ``make`` builds it, and is only called when there is an observer.
    """
    observers = current().observers
    if not observers:
        return
    result = make()
    for cb in observers:
        cb.on_result(name, result)


# ------------------------------------------------------------------------- what a phase uses
class BatchSource(Protocol):
    """The mini-batches of a phase."""

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """The index arrays of ``epoch``'s mini-batches, in order."""

    def load(self, batches: list[np.ndarray]) -> Iterable[Any]:
        """One item per batch of ``batches`` (what the loss takes), in order; an item with a
        ``shard`` attribute is this rank's part of the batch.
        """


class PhaseLoss(Protocol):
    """The objective of a phase; ``terms``: the names of what a call returns (the first is
    optimised, all are averaged into the epoch's record).
    """

    terms: tuple[str, ...]

    def start_epoch(self, net: torch.nn.Module, epoch: int) -> dict:
        """Refresh the state of ``epoch`` (before its steps); entries for its record."""

    def may_stop(self, epoch: int) -> bool:
        """Whether the stopping rule may end the phase in ``epoch``."""

    def __call__(self, model: torch.nn.Module, item: Any) -> Sequence[torch.Tensor]:
        """The loss terms of one batch item."""


class StopState:
    """The state of a stopping rule over one phase: every ``every`` optimiser steps it is
    checked on the heads ``heads_of(net)`` of a fixed sample of cells; it says stop, once
    ``min_steps`` steps have run, when both

    * the mean loss of the last ``every`` steps fell by less than two standard errors of the
      difference from the ``every`` steps before, and
    * the share of the sampled cells whose head changed since the previous check is below
      ``tolerance``, or has stopped falling (see :meth:`heads_settled`).
    """

    def __init__(
        self,
        every: int,
        min_steps: int,
        tolerance: float,
        heads_of: Callable[[torch.nn.Module], np.ndarray] | None,
    ) -> None:
        self.every, self.min_steps, self.tolerance = every, min_steps, tolerance
        self.heads_of = heads_of
        self.steps = 0
        self.checked = False  # whether the last call of :meth:`after` was a check
        self.losses: list[torch.Tensor] = []
        self.heads: np.ndarray | None = None
        self.window: tuple[float, float] | None = None  # mean, standard error of the last window
        self.changed = float("nan")
        self.changed_before = float("nan")
        self.loss_fall = float("nan")
        self.loss_noise = float("nan")

    @classmethod
    def never(cls) -> StopState:
        """A state that never checks (the phase runs its schedule), its figures NaN."""
        return cls(0, 0, 0.0, None)

    def windows(self, batches: list[np.ndarray]) -> list[list[np.ndarray]]:
        """``batches`` cut where a check falls (every ``every`` steps of the phase)."""
        if self.every <= 0:
            return [batches]
        out, start, done = [], 0, self.steps
        while start < len(batches):
            take = self.every - done % self.every
            out.append(batches[start : start + take])
            start, done = start + take, done + take
        return out

    def after(self, net: torch.nn.Module, losses: torch.Tensor) -> bool:
        """Account for the steps just run (their ``losses``); at a check, whether to stop."""
        self.steps += losses.numel()
        self.checked = self.every > 0 and self.steps % self.every == 0
        if self.every <= 0:
            return False
        self.losses.append(losses)
        if not self.checked:
            return False
        window = torch.cat(self.losses).double().cpu().numpy()
        self.losses = []
        mean = float(window.mean())
        se = float(window.std(ddof=1) / np.sqrt(window.size)) if window.size > 1 else 0.0
        heads = self.heads_of(net)
        net.train()
        if self.heads is not None:
            self.changed_before = self.changed
            self.changed = float((heads != self.heads).mean())
        if self.window is not None:
            self.loss_fall = self.window[0] - mean
            self.loss_noise = 2.0 * float(np.hypot(self.window[1], se))
        self.heads, self.window = heads, (mean, se)
        return (
            self.steps >= self.min_steps
            and self.loss_fall < self.loss_noise
            and (self.changed < self.tolerance or self.heads_settled(heads.size))
        )

    def heads_settled(self, n: int) -> bool:
        """Whether the share of the ``n`` sampled cells changing head fell by less than two
        binomial standard errors of the difference between the last two checks.
        """
        p0, p1 = self.changed_before, self.changed
        if not (np.isfinite(p0) and np.isfinite(p1)):
            return False
        return p0 - p1 < 2.0 * np.sqrt((p0 * (1 - p0) + p1 * (1 - p1)) / n)

    def record(self) -> dict:
        """The last check's figures, for an epoch's record."""
        return {"changed": self.changed, "loss_fall": self.loss_fall,
                "loss_noise": self.loss_noise}  # fmt: skip


# ------------------------------------------------------------------------------- the loop
def epoch_bar(epochs, desc: str, enabled: bool):
    """A tqdm bar over ``epochs`` on stderr; in a log file (stderr not a terminal) it refreshes
    every 10 s instead of many times a second.
    """
    from tqdm import tqdm

    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(
        epochs,
        desc=desc,
        unit="epoch",
        disable=not enabled,
        leave=False,
        mininterval=0.1 if tty else 10.0,
    )


def fit_phase(
    net: torch.nn.Module,
    loss: PhaseLoss,
    batches: BatchSource,
    optimizer: torch.optim.Optimizer,
    epochs: Iterable[int],
    *,
    phase: str,
    stop: StopState | None = None,
    model: torch.nn.Module | None = None,
    callbacks: Sequence[Callback] = (),
    history: list[dict] | None = None,
    desc: str | None = None,
    progress: bool = False,
) -> list[dict]:
    """Train ``net`` in place over ``epochs`` (epoch numbers of the whole run), or until
    ``stop`` says so (never in an epoch where ``loss.may_stop`` is false). ``model``: what the
    steps call (``net`` wrapped, e.g. in ``DistributedDataParallel``; default ``net``).

    Appends one record per epoch to ``history`` (a new list by default) and returns it: the
    epoch, the mean of each loss term, the loss's own entries, ``steps`` and ``seconds``; with
    ``stop`` also the last check's figures, the last record with ``stopped``:
    ``"converged"`` or ``"schedule"``. A non-finite loss raises
    :class:`~orca_sc._errors.TrainingDivergedError`.

    Nothing in a step waits for the device: each stretch of batches between two checks is
    loaded by the source at once, and the loss terms are summed on the device and read once
    per stretch.
    """
    model = net if model is None else model
    history = [] if history is None else history
    callbacks = (*callbacks, *current().observers)
    first = len(history)
    for cb in callbacks:
        cb.on_phase_start(phase, net)
    bar = epoch_bar(epochs, desc or phase, progress)
    converged = False
    for epoch in bar:
        t_epoch = time.perf_counter()
        info = loss.start_epoch(net, epoch)
        net.train()
        plan = batches.epoch(epoch)
        sums, n_done = np.zeros(len(loss.terms)), 0
        for window in stop.windows(plan) if stop is not None else [plan]:
            window_sums, losses = _steps(model, loss, batches.load(window), optimizer)
            sums, n_done = sums + window_sums * len(window), n_done + len(window)
            if stop is None:
                continue
            verdict = stop.after(net, losses)
            keep = False
            if stop.checked:
                keep = any([bool(cb.on_check(phase, stop, verdict)) for cb in callbacks])
            converged = verdict and not keep and loss.may_stop(epoch)
            if converged:
                break
        sums /= max(1, n_done)
        if not np.isfinite(sums[0]):
            msg = (
                f"The training loss became {sums[0]} in epoch {epoch + 1}; lower the learning "
                "rate (lr=...) or check the input for extreme values."
            )
            raise TrainingDivergedError(msg)
        record = {"epoch": epoch + 1, **dict(zip(loss.terms, map(float, sums), strict=True))}
        record |= info | {"steps": n_done, "seconds": time.perf_counter() - t_epoch}
        if stop is not None:
            record |= stop.record() | {"stopped": ""}
        history.append(record)
        for cb in callbacks:
            cb.on_epoch_end(phase, net, record)
        bar.set_postfix({k: f"{record[k]:.3f}" for k in _POSTFIX if k in record}, refresh=False)
        if converged:
            break
    bar.close()
    if stop is not None and len(history) > first:
        history[-1]["stopped"] = "converged" if converged else "schedule"
    if converged:
        logger.info(
            "%s converged after %d steps: %.1f%% of the sampled cells changed head, the loss fell "
            "%.4f (noise %.4f).", phase.capitalize(), stop.steps, 100 * stop.changed,
            stop.loss_fall, stop.loss_noise,
        )  # fmt: skip
    for cb in callbacks:
        cb.on_phase_end(phase, net, history[first:])
    return history


#: record entries shown beside the progress bar
_POSTFIX = ("loss", "uncertainty", "u_seen", "u_novel")


def _steps(
    model: torch.nn.Module, loss: PhaseLoss, items: Iterable[Any], optimizer: torch.optim.Optimizer
) -> tuple[np.ndarray, torch.Tensor]:
    """One optimiser step per item, in order; the mean of each loss term over them (on the
    host) and the optimised loss of each step (on the device).
    """
    sums: torch.Tensor | None = None
    losses: list[torch.Tensor] = []
    for item in items:
        with sharded(getattr(item, "shard", None)):
            parts = loss(model, item)
            optimizer.zero_grad(set_to_none=True)
            parts[0].backward()
        optimizer.step()
        terms = torch.stack([p.detach() for p in parts])
        sums = terms if sums is None else sums + terms
        losses.append(parts[0].detach())
    if sums is None:
        return np.zeros(len(loss.terms)), torch.zeros(0)
    return sums.cpu().numpy() / len(losses), torch.stack(losses)
