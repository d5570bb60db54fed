"""The one training loop (:mod:`orca_sc._engine`): what a phase records, that a diverging loss
stops it, that its hooks see every stage, check and decision of a real run without changing a
result, and the shard context that replaced ``shard=`` in the forward passes.
"""

import os

import numpy as np
import pytest
import torch
from conftest import FAST, FAST_LAB, FAST_OPTIONS, open_world

import orca_sc
from orca_sc._dist import active_shard, sharded
from orca_sc._engine import Callback, StopState, fit_phase
from orca_sc._errors import TrainingDivergedError
from orca_sc._train import schedule
from orca_sc.benchmark import StageCensus, StageTimer, StopTrace, observe


class _Rows:
    """Batches of a toy regression: every epoch a permutation of ``n`` rows in batches of 16."""

    def __init__(self, x, y, seed=0):
        self.x, self.y, self.rng = x, y, np.random.default_rng(seed)

    def epoch(self, epoch):
        return np.array_split(self.rng.permutation(len(self.x)), len(self.x) // 16)

    def load(self, batches):
        return ((self.x[b], self.y[b]) for b in batches)


class _Squared:
    terms = ("loss", "half")

    def __init__(self, scale=1.0):
        self.scale, self.epochs = scale, []

    def start_epoch(self, net, epoch):
        self.epochs.append(epoch)
        return {"scale": self.scale}

    def may_stop(self, epoch):
        return True

    def __call__(self, model, item):
        x, y = item
        loss = self.scale * ((model(x).squeeze(1) - y) ** 2).mean()
        return loss, loss / 2


def _toy(n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0])


class _Seen(Callback):
    def __init__(self):
        self.events = []

    def on_phase_start(self, phase, net):
        self.events.append(("start", phase))

    def on_epoch_end(self, phase, net, record):
        self.events.append(("epoch", record["epoch"]))
        record["seen_by_callback"] = True

    def on_phase_end(self, phase, net, history):
        self.events.append(("end", len(history)))


def test_a_phase_records_each_epoch_and_learns():
    x, y = _toy()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    loss, seen = _Squared(), _Seen()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    hist = fit_phase(net, loss, _Rows(x, y), opt, range(3, 8), phase="toy", callbacks=[seen])
    assert loss.epochs == [3, 4, 5, 6, 7]
    assert [h["epoch"] for h in hist] == [4, 5, 6, 7, 8]
    assert all(h["steps"] == 8 and h["scale"] == 1.0 and h["seen_by_callback"] for h in hist)
    assert all(h["half"] == pytest.approx(h["loss"] / 2, rel=1e-5) for h in hist)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    assert "stopped" not in hist[-1]  # no stopping rule: nothing to say
    assert seen.events == [("start", "toy"), *[("epoch", e) for e in range(4, 9)], ("end", 5)]


def test_a_diverging_loss_stops_the_phase_with_a_clear_error():
    x, y = _toy()
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TrainingDivergedError, match="in epoch 1; lower the learning rate"):
        fit_phase(net, _Squared(scale=float("nan")), _Rows(x, y), opt, range(3), phase="toy")


def test_a_check_can_keep_a_phase_going_and_the_last_record_says_why_it_ended():
    x, y = _toy()
    net = torch.nn.Linear(4, 1)

    def heads(net):  # constant heads: the rule stops as soon as the loss stops falling
        return np.zeros(10, dtype=np.int64)

    def run(callbacks):
        stop = StopState(every=4, min_steps=0, tolerance=0.5, heads_of=heads)
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        src = _Rows(x, y)
        return fit_phase(net, _Squared(), src, opt, range(40), phase="toy", stop=stop,
                         callbacks=callbacks), stop  # fmt: skip

    hist, stop = run([])
    assert hist[-1]["stopped"] == "converged" and len(hist) < 40
    assert stop.steps % 4 == 0 and stop.loss_fall < stop.loss_noise

    class Keep(Callback):
        checks = 0

        def on_check(self, phase, state, verdict):
            Keep.checks += 1
            return True

    hist, stop = run([Keep()])
    assert len(hist) == 40 and hist[-1]["stopped"] == "schedule"
    assert Keep.checks == 40 * 8 // 4


def test_the_shard_context_is_set_only_inside_a_step():
    assert active_shard() is None
    with sharded("part"):
        assert active_shard() == "part"
        with pytest.raises(ValueError), sharded(None):
            assert active_shard() is None
            raise ValueError
        assert active_shard() == "part"
    assert active_shard() is None


@pytest.fixture(scope="module")
def annotated_twice():
    """The same small run with and without hooks installed."""
    a = orca_sc.datasets.simulate(600, 300, 5, markers_per_type=30, marker_fold=5.0, seed=3)
    a = open_world(a, ["type_0", "type_1", "type_2"])
    cfg = FAST | {"ablation": FAST_LAB.replace(stop_min_steps=0)}
    plain = a.copy()
    orca_sc.tl.annotate(plain, labels_key="lab", **cfg)
    watched = a.copy()
    timer, trace, census = StageTimer(), StopTrace(task="sim"), StageCensus()
    with observe(timer, trace, census):
        orca_sc.tl.annotate(watched, labels_key="lab", **cfg)
    return plain, watched, timer, trace, census


def test_hooks_see_every_stage_and_check_and_change_nothing(annotated_twice):
    plain, watched, timer, trace, _ = annotated_twice
    assert plain.obs["orca_label"].equals(watched.obs["orca_label"])
    assert np.array_equal(plain.obsm["X_orca"], watched.obsm["X_orca"])
    for stage in ("prepare", "alignment", "warm-up", "cross-fitted warm-ups", "discovery",
                  "open-world fit", "inference", "novelty test (cross-fit)",
                  "naming, novelty and calibration"):  # fmt: skip
        assert timer.calls[stage] == 1, stage
    assert timer.calls["fold warm-ups"] == 5
    assert timer.calls["margin refresh"] >= 2  # one per epoch of each phase
    assert timer.seconds["cross-fitted warm-ups"] >= timer.seconds["fold warm-ups"] > 0
    assert timer.phases["warm-up"] > 0 and timer.phases["open-world"] > 0
    # the trace: every check of the run's phases (main warm-up, open-world, five folds)
    phases = {r["phase"].split(":")[1] for r in trace.rows}
    assert phases == {"warm-up", "open-world"}
    assert all(r["task"] == "sim" and r["step"] % 25 == 0 for r in trace.rows)
    hist = watched.uns["orca"]["history"]
    warmup_steps = int(np.asarray(hist["steps"])[np.asarray(hist["warmup"], bool)].sum())
    first = [r for r in trace.rows if r["phase"].startswith("1:")]
    assert max(r["step"] for r in first) == warmup_steps // 25 * 25


def test_the_census_follows_every_cell_through_discovery_the_fit_and_the_naming(annotated_twice):
    _, watched, _, _, census = annotated_twice
    assert census.candidate.shape == census.head.shape == (watched.n_obs,)
    labelled = watched.obs["lab"].notna().to_numpy()
    at = census.stages(np.arange(watched.n_obs))
    assert not at["in_candidate"][labelled].any()  # candidates are unlabelled cells
    called = watched.obs["orca_novel"].notna().to_numpy()
    # a cell called novel was on a novel head after the fit, and not on one named a known type
    assert called.any() and not (called & ~at["novel_after_fit"]).any()
    assert not (called & at["named_known"]).any()
    # the hidden types' cells are the candidates, far more than the known types' unlabelled cells
    hidden = ~watched.obs["cell_type"].isin(["type_0", "type_1", "type_2"]).to_numpy()
    known = ~hidden & ~labelled
    assert at["in_candidate"][hidden].mean() > 0.8 > 0.2 > at["in_candidate"][known].mean()
    with pytest.raises(RuntimeError, match="no run was observed"):
        StageCensus().stages(np.arange(3))


def test_a_trace_that_runs_the_schedule_trains_every_epoch():
    a = orca_sc.datasets.simulate(400, 200, 4, markers_per_type=30, marker_fold=5.0, seed=1)
    a = open_world(a, ["type_0", "type_1"])
    lab = FAST_LAB.replace(stop_min_steps=0, epoch_min_steps=80)
    cfg = FAST | {"ablation": lab, "novelty_folds": 0}
    plain = a.copy()
    orca_sc.tl.annotate(plain, labels_key="lab", **cfg)
    with observe(StopTrace(run_schedule=True)) as (trace,):
        orca_sc.tl.annotate(a, labels_key="lab", **cfg)
    plan = schedule(a.n_obs, orca_sc.OrcaConfig(**FAST_OPTIONS), lab)
    stopped = plain.uns["orca"]["history"]["stopped"]
    assert "converged" in set(stopped) and len(stopped) < plan.n_epochs
    hist = a.uns["orca"]["history"]
    assert len(hist["epoch"]) == plan.n_epochs
    assert set(hist["stopped"]) <= {"", "schedule"}
    assert any(r["would_stop"] for r in trace.rows)  # the rule said stop, and was overruled


def test_reproducible_turns_on_deterministic_kernels_on_a_gpu_only_and_restores_the_callers(
    monkeypatch,
):
    """On CUDA the run uses torch's deterministic algorithms (two 20,000-cell runs on a GPU gave
    different embeddings without them) with cuBLAS's reproducible workspace; the caller's setting
    comes back afterwards, also after an error; on the CPU nothing is touched.
    """
    from orca_sc._cells import reproducible

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with reproducible("cpu"):
        assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with reproducible(torch.device("cuda")):
                assert torch.are_deterministic_algorithms_enabled()
                assert torch.is_deterministic_algorithms_warn_only_enabled()
                assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
                raise RuntimeError("inside")
        assert not torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)  # a caller's own strict setting survives
        with reproducible("cuda:0"):
            assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("density", [0.05, 0.5])  # the sparse and the dense CPU layout
def test_the_margins_batches_are_built_once_and_read_with_the_current_weights(density):
    """The margin's refresh reads the same fixed cells every epoch, so their batches are built
    once per phase; what it returns still follows the net: with the kept batches it equals a
    refresh that builds them again, before and after the weights change.
    """
    import scipy.sparse as sp

    from orca_sc._cells import CellMatrix, uncertainty_batches
    from orca_sc._loss import mean_uncertainty
    from orca_sc.module import OrcaNet

    rng = np.random.default_rng(0)
    X = sp.random(300, 40, density=density, format="csr", dtype=np.float32, random_state=1)
    domain = rng.integers(0, 2, 300)
    scale = np.ones((2, 40), np.float32)
    offset = rng.normal(size=(2, 40)).astype(np.float32)
    cells = CellMatrix(X, domain, scale, offset, torch.device("cpu"))
    assert cells.layout == ("sparse" if density < 0.2 else "dense")
    torch.manual_seed(0)
    net = OrcaNet(40, 5, (16, 8), 0.1)
    rows = np.sort(rng.choice(300, 120, replace=False))
    kept = uncertainty_batches(cells, rows)
    before = mean_uncertainty(net, cells, rows, batches=kept)
    assert before == mean_uncertainty(net, cells, rows)
    with torch.no_grad():  # a training step's worth of change, in every layer
        for p in net.parameters():
            p.add_(0.5 * torch.randn_like(p))
    after = mean_uncertainty(net, cells, rows, batches=kept)
    assert after == mean_uncertainty(net, cells, rows) and after != before
