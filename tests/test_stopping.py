"""The stopping rule of training (``Ablation.stop_tolerance``): where checks fall, that a phase
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
from orca_sc._ablation import Ablation
from orca_sc._cells import CellMatrix
from orca_sc._train import StopRule, stop_rule, stop_state


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
    assert stop_rule(10_000, cfg, Ablation(stop_tolerance=0)) is None
    assert stop_rule(10_000, cfg, Ablation(stop_check_steps=7)).every == 7


@pytest.mark.parametrize(
    ("field", "value"),
    [("stop_tolerance", 1.5), ("stop_tolerance", -0.1), ("stop_check_steps", 0),
     ("stop_min_steps", -1)],
)  # fmt: skip
def test_stopping_settings_are_validated(field, value):
    with pytest.raises(orca_sc.OrcaInputError, match=field):
        Ablation(**{field: value})


@pytest.fixture(scope="module")
def separable():
    """3,000 cells of 6 well-separated types, 4 of them half labelled: 6 steps an epoch."""
    a = orca_sc.datasets.simulate(3000, 300, 6, markers_per_type=30, marker_fold=5.0, seed=7)
    return open_world(a, [f"type_{i}" for i in range(4)])


LAB = Ablation(stop_min_steps=50, stop_check_steps=10)
OPTS = {"n_genes": None, "progress": False, "ablation": LAB, **LABELS_ONLY}


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
    full = orca_sc.tl.annotate(
        separable,
        labels_key="lab",
        copy=True,
        **{**OPTS, "ablation": LAB.replace(stop_tolerance=0)},
    )
    for ph in full.uns["orca"]["training"]["phases"].values():
        assert ph["stopped"] == "schedule" and ph["steps"] == ph["max_steps"]
        assert np.isnan(ph["changed"])
    assert _accuracy(full) > 0.9 and _accuracy(a) >= _accuracy(full) - 0.01
    # a tolerance no run can meet (no cell may change, ever) is the schedule again
    strict = orca_sc.tl.annotate(
        separable,
        labels_key="lab",
        copy=True,
        **{**OPTS, "ablation": LAB.replace(stop_tolerance=1e-9, stop_min_steps=10**6)},
    )
    for ph in strict.uns["orca"]["training"]["phases"].values():
        assert ph["stopped"] == "schedule" and ph["steps"] == ph["max_steps"]


def test_same_seed_same_stop(separable, stopped):
    a = stopped
    b = orca_sc.tl.annotate(separable, labels_key="lab", copy=True, **OPTS)
    assert a.uns["orca"]["training"]["phases"] == b.uns["orca"]["training"]["phases"]
    assert (a.obs["orca_label"] == b.obs["orca_label"]).all()


def test_checks_fall_every_so_many_steps_in_every_phase(separable):
    """Batches of 100 make 30 steps an epoch: the checks of every phase (warm-ups and open-world
    fit) fall every 10 steps, across epochs, and the record says so.
    """
    from orca_sc._engine import observe
    from orca_sc.benchmark._hooks import StopTrace

    with observe(StopTrace()) as (trace,):
        a = orca_sc.tl.annotate(
            separable, labels_key="lab", copy=True, **{**OPTS, "batch_size": 100}
        )
    checks = [(r["phase"], r["step"]) for r in trace.rows]
    assert {p.split(":")[1] for p, _ in checks} == {"warm-up", "open-world"}
    assert {ph["check_steps"] for ph in a.uns["orca"]["training"]["phases"].values()} == {10}
    assert all(step % 10 == 0 for _, step in checks) and any(step % 30 for _, step in checks)
