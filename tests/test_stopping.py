"""The stopping rule of training (``OrcaConfig.stop_tolerance``): where checks fall, that a phase
stops only when its stated criterion holds, that stopping costs no accuracy on data the model
has learnt, and that the run's record says why and when each phase stopped.
"""

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from conftest import LABELS_ONLY, open_world

import orca_sc
from orca_sc import OrcaConfig
from orca_sc._train import CellMatrix, StopRule, stop_rule, stop_state


def _cells(n=40, g=5):
    X = sp.csr_matrix(np.random.default_rng(0).random((n, g)).astype(np.float32))
    one, zero = np.ones((1, g), np.float32), np.zeros((1, g), np.float32)
    return CellMatrix(X, np.zeros(n, dtype=np.int64), one, zero, torch.device("cpu"))


def test_checks_fall_every_so_many_steps_across_epochs():
    rule = StopRule(np.arange(10), tolerance=0.01, every=25, min_steps=0)
    state = stop_state(rule, _cells(), None)
    batches = [np.arange(2)] * 10  # an epoch of 10 steps
    cuts = []
    for _ in range(3):
        windows = state.windows(batches)
        assert sum(len(w) for w in windows) == 10
        for w in windows:
            state.steps += len(w)  # as after() counts them
            cuts.append(state.steps)
    # a window ends at every check (25, 50) and at every epoch's end (10, 20, 30)
    assert cuts == [10, 20, 25, 30]
    assert stop_state(None, _cells(), None).windows(batches) == [batches]


def test_the_sample_is_fixed_by_the_seed_and_tolerance_zero_is_the_schedule():
    cfg = OrcaConfig(seed=3)
    a, b = stop_rule(10_000, cfg), stop_rule(10_000, cfg)
    assert np.array_equal(a.sample, b.sample) and a.sample.size == 2000
    assert np.unique(a.sample).size == 2000 and a.sample.max() < 10_000
    assert not np.array_equal(a.sample, stop_rule(10_000, cfg.replace(seed=4)).sample)
    assert stop_rule(50, cfg).sample.size == 50
    assert stop_rule(10_000, cfg.replace(stop_tolerance=0)) is None


def test_checks_are_an_epoch_apart_where_an_epoch_has_more_steps():
    cfg = OrcaConfig(stop_check_steps=25, stop_every_epoch=True)
    assert stop_rule(10_000, cfg, steps_per_epoch=40).every == 40
    assert stop_rule(10_000, cfg, steps_per_epoch=10).every == 25
    assert stop_rule(10_000, cfg.replace(stop_every_epoch=False), steps_per_epoch=40).every == 25
    assert stop_rule(10_000, OrcaConfig(), steps_per_epoch=40).every == 25  # the default
    warm = cfg.replace(stop_every_epoch="warm-up")  # the warm-ups a pass apart, not the fit
    assert stop_rule(10_000, warm, steps_per_epoch=40, phase="warm-up").every == 40
    assert stop_rule(10_000, warm, steps_per_epoch=40, phase="open-world").every == 25


@pytest.mark.parametrize(
    ("field", "value"),
    [("stop_tolerance", 1.5), ("stop_tolerance", -0.1), ("stop_check_steps", 0),
     ("stop_min_steps", -1), ("stop_every_epoch", "yes")],
)  # fmt: skip
def test_stopping_options_are_validated(field, value):
    with pytest.raises(orca_sc.OrcaInputError, match=field):
        OrcaConfig(**{field: value})


@pytest.fixture(scope="module")
def separable():
    """3,000 cells of 6 well-separated types, 4 of them half labelled: 6 steps an epoch."""
    a = orca_sc.datasets.simulate(3000, 300, 6, markers_per_type=30, marker_fold=5.0, seed=7)
    return open_world(a, [f"type_{i}" for i in range(4)])


OPTS = {"n_genes": None, "progress": False, "stop_min_steps": 50, "stop_check_steps": 10,
        **LABELS_ONLY}  # fmt: skip


@pytest.fixture(scope="module")
def stopped(separable):
    """The run with the stopping rule on :func:`separable`, shared by the tests that read it."""
    return orca_sc.tl.annotate(separable, labels_key="lab", copy=True, **OPTS)


def _accuracy(a):
    """All-class accuracy of the unlabelled cells (novel clusters matched to novel types)."""
    return orca_sc.metrics.report(a, "cell_type")["all_accuracy"]


def test_a_phase_stops_when_its_criterion_holds_and_not_before(separable, stopped):
    a = stopped
    phases = a.uns["orca"]["training"]["phases"]
    ow = phases["open-world"]
    # this data is learnt long before the schedule's end: the fit stops, and says why
    assert ow["stopped"] == "converged" and 50 <= ow["steps"] < ow["max_steps"]
    assert ow["steps"] % 10 == 0
    assert ow["changed"] < ow["stop_tolerance"] and ow["loss_fall"] < ow["loss_noise"]
    for ph in phases.values():
        assert ph["stopped"] in ("converged", "schedule") and ph["steps"] <= ph["max_steps"]
    h = a.uns["orca"]["history"]
    assert list(h["stopped"]).count("converged") >= 1 and h["stopped"][-1] == "converged"
    assert a.uns["orca"]["training"]["steps"] == sum(p["steps"] for p in phases.values())
    # the paper's schedule (tolerance 0): every step runs, and is no more accurate here
    full = orca_sc.tl.annotate(separable, labels_key="lab", copy=True, stop_tolerance=0, **OPTS)
    for ph in full.uns["orca"]["training"]["phases"].values():
        assert ph["stopped"] == "schedule" and ph["steps"] == ph["max_steps"]
        assert np.isnan(ph["changed"])
    assert _accuracy(full) > 0.9 and _accuracy(a) >= _accuracy(full) - 0.01
    # a tolerance no run can meet (no cell may change, ever) is the schedule again
    strict = orca_sc.tl.annotate(
        separable, labels_key="lab", copy=True, **{**OPTS, "stop_tolerance": 1e-9,
                                                    "stop_min_steps": 10**6}
    )  # fmt: skip
    for ph in strict.uns["orca"]["training"]["phases"].values():
        assert ph["stopped"] == "schedule" and ph["steps"] == ph["max_steps"]


def test_same_seed_same_stop(separable, stopped):
    a = stopped
    b = orca_sc.tl.annotate(separable, labels_key="lab", copy=True, **OPTS)
    assert a.uns["orca"]["training"]["phases"] == b.uns["orca"]["training"]["phases"]
    assert (a.obs["orca_label"] == b.obs["orca_label"]).all()


def test_a_phase_of_long_epochs_is_checked_after_whole_passes(separable):
    """Batches of 100 make 30 steps an epoch, more than the 10 steps between checks: every check
    of every phase (warm-ups and open-world fit) falls at the end of an epoch, so the heads and
    the loss are compared pass against pass; with ``stop_every_epoch=False`` (the default)
    every 10 steps.
    """
    from orca_sc._engine import observe
    from orca_sc.benchmark._hooks import StopTrace

    def check_steps(**kw):
        with observe(StopTrace()) as (trace,):
            a = orca_sc.tl.annotate(
                separable, labels_key="lab", copy=True, **{**OPTS, "batch_size": 100, **kw}
            )
        return a, [(r["phase"], r["step"]) for r in trace.rows]

    a, checks = check_steps(stop_every_epoch=True)
    assert checks and all(step % 30 == 0 for _, step in checks)
    assert {p.split(":")[1] for p, _ in checks} == {"warm-up", "open-world"}
    phases = a.uns["orca"]["training"]["phases"]
    assert phases["open-world"]["stopped"] == "converged"
    assert {ph["check_steps"] for ph in phases.values()} == {30}
    b, fixed = check_steps()
    assert {ph["check_steps"] for ph in b.uns["orca"]["training"]["phases"].values()} == {10}
    assert all(step % 10 == 0 for _, step in fixed) and any(step % 30 for _, step in fixed)
    # "warm-up": the warm-ups (the main one and the fold copies) a pass apart, the fit not
    c, mixed = check_steps(stop_every_epoch="warm-up")
    phases = c.uns["orca"]["training"]["phases"]
    assert phases["warm-up"]["check_steps"] == 30 and phases["open-world"]["check_steps"] == 10
    warm = [step for p, step in mixed if p.endswith(":warm-up")]
    assert warm and all(step % 30 == 0 for step in warm)
    assert all(step % 10 == 0 for p, step in mixed if p.endswith(":open-world"))
