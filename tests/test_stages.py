"""Contracts of the stages behind ``tl.annotate``: discover on arrays, the trainer on arrays
(nothing of ``tl`` or AnnData), configuration precedence and the scanpy-style return.
"""

import ast
import importlib
import inspect
import pkgutil
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from conftest import FAST, FAST_OPTIONS, LABELS_ONLY

import orca_sc
from orca_sc import OrcaConfig, OrcaModel
from orca_sc._ablation import Ablation, DiscoveryRules
from orca_sc._cells import CellMatrix
from orca_sc._discover import Discovery, DiscoveryInput, discover, pca_embedding
from orca_sc._train import NovelHeads, TrainRandom, fit_open_world, fit_warmup, schedule


def _blobs(n_per=60, n_types=5, dim=8, seed=0):
    """Well-separated groups in an embedding; types 0-2 seen (half labelled), 3-4 novel."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(n_types, dim)) * 4
    truth = np.repeat(np.arange(n_types), n_per)
    x = centers[truth] + rng.normal(size=(truth.size, dim))
    labels = np.where((truth < 3) & (rng.random(truth.size) < 0.5), truth, -1)
    return x, truth, labels


def _discover_blobs(x, labels, **kwargs):
    """``discover`` on :func:`_blobs` in one batch, with the seen "heads" the labelled class
    means (novel cells are far from all of them) and the blobs themselves as the PCA.
    """
    emb = x / np.linalg.norm(x, axis=1, keepdims=True)
    heads = np.stack([emb[labels == k].mean(0) for k in range(3)])
    heads /= np.linalg.norm(heads, axis=1, keepdims=True)
    cells = DiscoveryInput(emb, emb @ heads.T, labels, np.zeros_like(labels), lambda i: x[i])
    return discover(cells, **kwargs)


def test_discover_on_arrays_returns_the_documented_fields():
    x, truth, labels = _blobs()
    found = _discover_blobs(x, labels)
    assert isinstance(found, Discovery)
    with pytest.raises(AttributeError):  # frozen
        found.n_novel = 3
    assert found.n_novel == len(found.sizes) == found.n_heads == 2
    assert found.assign.shape == labels.shape
    for j in range(found.n_novel):  # each candidate is (nearly all) one novel type
        members = truth[found.assign == j]
        main = np.bincount(members).argmax()
        assert members.size == found.sizes[j] and main >= 3 and (members == main).mean() > 0.95
    assert found.prototypes.shape == (2, x.shape[1])
    np.testing.assert_allclose(np.linalg.norm(found.prototypes, axis=1), 1, rtol=1e-6)
    assert found.prior.shape == (5,) and np.isclose(found.prior.sum(), 1)
    assert found.anchor_cells.size == found.anchor_heads.size
    # a novel head for the candidates' core cells, the seen head of its own blob for unlabelled
    # known cells as labelled around as labelled cells are (anchor_supported)
    on_novel = found.anchor_heads >= 3
    assert (found.assign[found.anchor_cells[on_novel]] >= 0).all()
    held = found.anchor_cells[~on_novel]
    assert held.size > 0 and (labels[held] == -1).all() and (truth[held] < 3).all()
    np.testing.assert_array_equal(found.anchor_heads[~on_novel], truth[held])
    off = _discover_blobs(x, labels, cfg=DiscoveryRules(anchor_supported=False))
    assert (off.anchor_heads >= 3).all()
    assert found.diagnostics["n_novel"] == 2 and "resolution" in found.diagnostics
    # n_novel given above the estimate: extra heads start at random directions
    more = _discover_blobs(x, labels, n_novel=4)
    assert more.n_heads == 4 and more.n_novel == 2
    # every knob of the stage is a DiscoveryRules field: every cell "supported by labels" -> none
    off = _discover_blobs(x, labels, cfg=DiscoveryRules(support_fraction=0, support_min=0))
    assert off.n_novel == 0 and off.diagnostics["n_supported_by_labels"] >= (truth >= 3).sum()


def test_size_check_repeats_discovery_on_a_sample_and_says_where_they_disagree():
    """Large data: discovery repeated on a random sample of the cells; the record says what
    each found, and a note says when none was found on all the cells but some on the sample.
    """
    from orca_sc._discover import size_check

    x, truth, labels = _blobs(n_per=100)

    def on(sub):
        return _discover_blobs(x[sub], labels[sub])

    found = _discover_blobs(x, labels)
    assert size_check(found, truth.size, on, sample_cells=truth.size // 2) is found  # too small
    same = size_check(found, truth.size, on, sample_cells=200)
    rec = same.diagnostics["size_check"]
    assert rec["sample_cells"] == 200 and rec["candidates"] == rec["sample_candidates"] == 2
    assert rec["agrees"] and same.notes == found.notes and same.n_novel == found.n_novel
    np.testing.assert_array_equal(same.assign, found.assign)  # labels are not touched
    # all the cells find nothing (every cell supported by labels), the sample finds the two types
    none = _discover_blobs(x, labels, cfg=DiscoveryRules(support_fraction=0, support_min=0))
    told = size_check(none, truth.size, on, sample_cells=200)
    assert not told.diagnostics["size_check"]["agrees"] and told.n_novel == 0
    assert len(told.notes) == len(none.notes) + 1
    assert "found 0 candidate novel cluster(s) among 500 cells, but 2 when" in told.notes[-1]
    assert "'no novel type' is not supported" in told.notes[-1]
    assert told.record()["notes"][-1] == told.notes[-1]
    # a threshold far below the sample's is degenerate: said, with both figures; labels kept
    assert not rec["threshold_degenerate"]
    assert rec["threshold_in_sample"] == found.diagnostics["threshold_in_sample"]
    low_tau = 0.4 * rec["sample_threshold"]
    low = replace(found, threshold=low_tau,
                  diagnostics={**found.diagnostics, "threshold_in_sample": low_tau})  # fmt: skip
    flat = size_check(low, truth.size, on, sample_cells=200)
    assert flat.diagnostics["size_check"]["threshold_degenerate"]
    assert flat.diagnostics["size_check"]["agrees"]  # the counts agree: only the threshold
    assert len(flat.notes) == len(found.notes) + 1 and "threshold" in flat.notes[-1]
    assert f"{low.threshold:.3f}" in flat.notes[-1]
    assert "query_votes" not in flat.notes[-1]  # no query cluster was voted on p-values
    np.testing.assert_array_equal(flat.assign, found.assign)
    # where query clusters were voted on their p-values, the note says that part holds
    voted = replace(low, diagnostics={**low.diagnostics, "query_votes": {"mean_p": [0.3, np.nan]}})
    said = size_check(voted, truth.size, on, sample_cells=200).notes[-1]
    assert "in batches with labelled cells" in said and "query_votes" in said


def test_discovery_n_neighbors_reaches_every_graph(monkeypatch):
    """``DiscoveryConfig.n_neighbors`` sets the kNN graph of every Leiden clustering of the
    stage (out-of-distribution cells, query clusters, resolution calibration), not only
    the labelled-neighbour tests.
    """
    import orca_sc._discover.graph as D

    x, _, labels = _blobs()
    used = []
    orig = D.knn_graph
    monkeypatch.setattr(D, "knn_graph", lambda e, k=15: used.append(k) or orig(e, k))
    found = _discover_blobs(x, labels, cfg=DiscoveryRules(n_neighbors=7))
    assert found.n_novel == 2
    assert len(used) >= 2 and set(used) == {7}  # calibration, candidate clusters


def test_trainer_runs_on_arrays_and_knows_nothing_of_tl():
    discovery = [importlib.import_module(f"orca_sc._discover.{m.name}")
                 for m in pkgutil.iter_modules(orca_sc._discover.__path__)]  # fmt: skip
    assert len(discovery) >= 7  # the package's modules, each checked
    for mod in (orca_sc._train, orca_sc._discover, orca_sc.module, *discovery):
        tree = ast.parse(inspect.getsource(mod))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m.split(".")[0] in ("anndata", "scanpy", "tl") for m in names), mod
        assert not any(".tl" in m or m == "tl" for m in names), mod
    a = orca_sc.datasets.simulate(400, 200, 4, markers_per_type=30, marker_fold=5.0, seed=1)
    X = sp.csr_matrix(np.log1p(a.X.toarray()).astype(np.float32))
    truth = a.obs["cell_type"].cat.codes.to_numpy()
    labels = np.where((truth < 2) & (np.arange(truth.size) % 2 == 0), truth, -1).astype(np.int64)
    dom = np.zeros(truth.size, dtype=np.int64)
    ones, zeros = np.ones((1, 200), np.float32), np.zeros((1, 200), np.float32)
    cfg = OrcaConfig(epochs=6, warmup_epochs=2, progress=False, hidden_dims=(32, 16))
    cells = CellMatrix(X, dom, ones, zeros, torch.device("cpu"))
    plan = schedule(X.shape[0], cfg, Ablation(epoch_min_steps=0))
    rand = TrainRandom(0, torch.device("cpu"))
    net, hist = fit_warmup(cells, labels, 2, cfg, plan, rand)
    assert net.n_heads == 2 and len(hist) == 2 and all(h["warmup"] for h in hist)
    protos = np.eye(2, 16)
    novel = NovelHeads(protos, anchor_rows=np.array([1, 3]), anchor_heads=np.array([2, 3]))
    pca = pca_embedding(X, dom, ones, zeros, n_comps=5)
    net2, hist2 = fit_open_world(net, cells, labels, novel, cfg, plan, rand, pca)
    assert net.n_heads == 2 and net2.n_heads == 4  # the warm-up net is not modified
    assert [h["epoch"] for h in hist2] == [3, 4, 5, 6] and hist2[0]["anchored"]
    assert all(h["pairwise"] > 0 for h in hist2)


def test_size_check_of_a_run_leaves_its_labels_alone(small_sim, monkeypatch):
    """With the check's sample below half the cells, a run records what discovery found on the
    sample (``estimate['size_check']``, from the sample's own PCA) and labels every cell as the
    run without it does; the summary carries discovery's notes.
    """
    import orca_sc._discover.scale as sc_mod

    plain = small_sim.copy()
    orca_sc.tl.annotate(plain, labels_key="lab", seed=0, **FAST, **LABELS_ONLY)
    assert "size_check" not in plain.uns["orca"]["estimate"]  # 500 cells: no check
    monkeypatch.setattr(sc_mod, "SAMPLE_CELLS", 150)
    import orca_sc._context as pipe

    matrices, real_embedding = [], pipe.pca_embedding

    def embedding(X, *args, **kw):
        matrices.append(X.shape[0])
        return real_embedding(X, *args, **kw)

    monkeypatch.setattr(pipe, "pca_embedding", embedding)
    checked = small_sim.copy()
    orca_sc.tl.annotate(checked, labels_key="lab", seed=0, **FAST, **LABELS_ONLY)
    assert 150 in matrices  # the sample's discovery reads the PCA of its own cells
    rec = checked.uns["orca"]["estimate"]["size_check"]
    assert rec["n_cells"] == 500 and rec["sample_cells"] == 150
    assert rec["candidates"] == checked.uns["orca"]["estimate"]["n_novel"]
    np.testing.assert_array_equal(plain.obs["orca_label"], checked.obs["orca_label"])
    summary = orca_sc.tl.summarize(checked, n_markers=0)
    record = orca_sc.tl.RunRecord.from_uns(checked.uns["orca"])
    assert summary["notes"] == [n.line for n in record.notes]
    assert set(checked.uns["orca"]["estimate"]["note_lines"]) <= set(summary["notes"])


def test_discovery_on_a_sample_of_fixed_size_finds_the_novel_types_of_every_cell(
    tmp_path, monkeypatch
):
    """Above ``discovery_cells`` cells the warm-ups and discovery run on a random sample of that
    size (recorded with the whole's size) and the run goes on over every cell: each query cell is
    labelled and has a novelty p-value, both novel types are found, the labelled cells outside
    the sample have no cross-fitted prediction (the card's accuracy reads the sampled ones).
    What the PCA reads (log values or Pearson residuals) is chosen once, on the sample, and the
    pair partners of every cell read what discovery read.
    """
    import orca_sc._context as pipe

    calls, read = [], []
    real_choose, real_residuals = pipe.choose_pca_input, pipe.RunContext.residuals

    def choose(run, residuals):
        calls.append(run.data.n_cells)
        return real_choose(run, residuals)

    def residuals(self):
        out = real_residuals(self)
        read.append((self.data.n_cells, out is None))
        return out

    monkeypatch.setattr(pipe, "choose_pca_input", choose)
    monkeypatch.setattr(pipe.RunContext, "residuals", residuals)
    a = orca_sc.datasets.simulate(2400, 300, 5, n_batches=2, markers_per_type=30,
                                  marker_fold=5.0, seed=4)  # fmt: skip
    types = a.obs["cell_type"].astype(str)
    ref = a[(a.obs["batch"] == "batch_0") & types.isin(["type_0", "type_1", "type_2"])].copy()
    query = a[a.obs["batch"] == "batch_1"].copy()
    q = query.copy()
    orca_sc.tl.annotate(q, ref, labels_key="cell_type", seed=0, discovery_cells=1000,
                        save_model=str(tmp_path / "model.pt"), **FAST)  # fmt: skip
    n_all = ref.n_obs + query.n_obs
    assert q.uns["orca"]["estimate"]["sample"] == {"cells": 1000, "of": n_all}
    assert calls == [1000]  # on the sample, not again on all the cells
    assert {n for n, _ in read} == {1000, n_all}  # discovery's PCA and the pair partners' ...
    assert len({log for _, log in read}) == 1  # ... read the same input
    assert np.isfinite(q.obs["orca_novelty_pvalue"]).all()
    truth = q.obs["cell_type"].astype(str).to_numpy()
    novel_true = np.isin(truth, ["type_3", "type_4"])
    called = q.obs["orca_novel"].notna().to_numpy()
    assert called[novel_true].mean() > 0.9 and called[~novel_true].mean() < 0.05
    found = called & novel_true  # each novel type in a cluster of its own
    clusters = pd.crosstab(truth[found], q.obs["orca_novel"].astype(str).to_numpy()[found])
    assert clusters.shape[0] == 2 and len(set(clusters.to_numpy().argmax(axis=1))) == 2
    accuracy = OrcaModel.load(tmp_path / "model.pt").card["accuracy"]
    assert accuracy["per_type"] and all(v is not None for v in accuracy["per_type"].values())
    assert len(q.uns["orca"]["training"]["phases"])  # the sampled warm-up is recorded


def test_the_pca_of_all_cells_is_computed_once(small_sim, monkeypatch):
    """Discovery and the pair partners both read the PCA of all cells: one computation, the
    same array, and the labels of a run that computes it twice.
    """
    import orca_sc._context as pipe

    computed, read = [], []
    real_pca, real_embedding = pipe.RunContext.pca, pipe.pca_embedding

    def embedding(X, *args, rows=None, **kw):
        computed.append(X.shape[0] if rows is None else rows.size)
        return real_embedding(X, *args, rows=rows, **kw)

    def pca(self, n_comps, rows=None):
        out = real_pca(self, n_comps, rows)
        if rows is None or rows.size == self.data.n_cells:
            read.append(out)
        return out

    monkeypatch.setattr(pipe, "pca_embedding", embedding)
    monkeypatch.setattr(pipe.RunContext, "pca", pca)
    once = small_sim.copy()
    orca_sc.tl.annotate(once, labels_key="lab", seed=0, **FAST, **LABELS_ONLY)
    n = once.n_obs
    assert len(read) >= 2 and all(r is read[0] for r in read)  # discovery and pairs share it
    assert computed.count(n) == 1

    def uncached(self, n_comps, rows=None):  # as before: every call computes
        t = self.transform
        return real_embedding(self.data.X, self.data.domain, t.scale, t.offset,
                              n_comps=n_comps, seed=self.config.seed, rows=rows)  # fmt: skip

    monkeypatch.setattr(pipe.RunContext, "pca", uncached)
    twice = small_sim.copy()
    orca_sc.tl.annotate(twice, labels_key="lab", seed=0, **FAST, **LABELS_ONLY)
    np.testing.assert_array_equal(once.obs["orca_label"], twice.obs["orca_label"])
    np.testing.assert_array_equal(once.obsm["X_orca"], twice.obsm["X_orca"])


def test_explicit_keyword_wins_over_config(small_sim):
    """``config=OrcaConfig(n_genes=100), n_genes=2000`` trains on 2000 genes (all 300 here),
    even though 2000 is the default; options not given come from ``config``; discovery
    fields go into ``config.discovery``.
    """
    cfg = OrcaConfig(**{**FAST_OPTIONS, "n_genes": 100, "seed": 5})
    a = orca_sc.tl.annotate(
        small_sim, labels_key="lab", config=cfg, n_genes=2000, merge_threshold=0.9, copy=True,
        **LABELS_ONLY,
    )  # fmt: skip
    u = a.uns["orca"]
    assert u["data"]["n_genes_used"] == 300
    assert u["params"]["seed"] == 5 and u["params"]["discovery"]["merge_threshold"] == 0.9
    b = orca_sc.tl.annotate(small_sim, labels_key="lab", config=cfg, copy=True, **LABELS_ONLY)
    assert b.uns["orca"]["data"]["n_genes_used"] == 100


def test_scanpy_style_return_and_one_way_to_the_model(small_sim, tmp_path):
    assert orca_sc.tl.annotate(small_sim, labels_key="lab", **FAST, **LABELS_ONLY) is None
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['return_model'\]"):
        orca_sc.tl.annotate(small_sim, labels_key="lab", return_model=True, **FAST)
    with pytest.raises(orca_sc.OrcaInputError, match="does not exist"):
        orca_sc.tl.annotate(
            small_sim, labels_key="lab", save_model=tmp_path / "no" / "m.pt", **FAST
        )
    # OrcaModel.fit trains the same model as annotate (same seed): same labels on the cells
    model = OrcaModel.fit(small_sim, labels_key="lab", **FAST, **LABELS_ONLY)
    labels, _, _ = model.predict(small_sim)
    np.testing.assert_array_equal(labels, small_sim.obs["orca_label"].astype(str).to_numpy())


def test_novelty_score_separates_novel_cells(small_run):
    small_sim = small_run.adata()
    nov = small_sim.obs["orca_novelty"].to_numpy()
    truth = small_sim.obs["cell_type"].astype(str)
    novel = truth.isin(["type_3", "type_4"]).to_numpy()
    labelled = small_sim.obs["lab"].notna().to_numpy()
    assert ((0 <= nov) & (nov <= 1)).all()
    # the labelled cells define the scale: about uniform on them
    assert abs(np.median(nov[labelled]) - 0.5) < 0.1
    assert np.median(nov[novel]) > 0.9 > np.median(nov[~novel & ~labelled])


def test_calibration_split_is_stratified_and_keeps_training_cells():
    from orca_sc._discover import calibration_split

    labels = np.r_[np.zeros(100), np.ones(10), np.full(2, 2), [3], np.full(50, -1)].astype(int)
    held = calibration_split(labels, 0.2, 2000, seed=0)
    assert held[labels == 0].sum() == 20 and held[labels == 1].sum() == 2
    assert held[labels == 2].sum() == 0 or held[labels == 2].sum() == 1
    assert not held[labels == 3].any() and not held[labels < 0].any()  # last cell, unlabelled
    for k in range(4):  # every class keeps a training cell
        assert (~held[labels == k]).any()
    capped = calibration_split(labels, 0.2, 11, seed=0)
    assert capped.sum() <= 12 and capped[labels == 0].sum() == 10
    assert not calibration_split(labels, 0.0, 2000).any()
    np.testing.assert_array_equal(held, calibration_split(labels, 0.2, 2000, seed=0))


def _sim_task(**kw):
    from orca_sc.benchmark import SimSetting, make_sim_task

    return make_sim_task(SimSetting("t", **{"n_genes": 300, **kw}), seed=0)


def _annotated(task, **config):
    """The task's scores and its annotated query."""
    from orca_sc.benchmark import annotate_task, score

    q, rows = annotate_task(task, 0, **config)
    pred = q.obs["orca_label"].astype(str).to_numpy()[rows]
    return score(task.truth, pred, task.seen, True), q


def _run(task, **config):
    r, q = _annotated(task, **config)
    return r, q.uns["orca"]


def test_few_labels_are_flagged_and_calibration_keeps_known_types_known(monkeypatch):
    """A 200-cell reference (8 seen types, the rarest with ~10 labelled cells) and a 150-cell
    query (~12 cells per type). With the threshold taken on the cells the warm-up trained on
    (the default), 37-63% of the known-type cells were called novel at seeds 0-2 of the
    development suite, and the output says the labels are few; calibrated on held-out cells
    (``calibration_fraction=0.2``), known cells stay known (seen 0.85).
    """
    task = _sim_task(n_ref=200, n_query=150)
    off, u_off = _run(task, **LABELS_ONLY)
    notes = u_off["estimate"]["notes"]
    assert any("Few labelled cells per known type" in n for n in notes)
    # a 150-cell query cannot support small novel types: the output says so too
    assert any("unlabelled cells" in n for n in notes)
    r, u = _run(task, calibration_fraction=0.2, **LABELS_ONLY)
    assert r["seen_acc"] >= 0.8 and r["known_called_novel"] <= 0.2
    assert u["estimate"]["n_calibration"] > 20
    assert u["estimate"]["threshold"] <= u["estimate"]["threshold_in_sample"]
    assert off["known_called_novel"] > r["known_called_novel"]


def test_per_type_thresholds_hold_each_types_rate_and_follow_a_query_shift():
    """Each known type's threshold is the ``alpha`` quantile of its own cross-fitted cosines: a
    tight type and a loose one both call about ``alpha`` of their unseen cells novel, where one
    pooled threshold would call many of the tight type's novel sibling cells known. In a query
    batch shifted down, the threshold follows the shift of the type's upper cosines (so its
    known cells stay known) and a novel subtype below them is still called; too few cells of a
    type keep the in-sample threshold.
    """
    from orca_sc._discover import type_thresholds

    rng = np.random.default_rng(0)
    n = 400
    tight = rng.normal(0.8, 0.02, n)  # type 0: cells close to their head
    loose = rng.normal(0.5, 0.1, n)  # type 1: a broad type
    labels = np.r_[np.zeros(n, int), np.ones(n, int)]
    held = np.r_[tight, loose]
    # unlabelled cells of the reference's batch: known cells of both types and a sibling of
    # type 0 that its head claims, scoring between the two types
    known0, known1 = rng.normal(0.8, 0.02, n), rng.normal(0.5, 0.1, n)
    sibling = rng.normal(0.7, 0.02, n)
    # a query batch: type 0 shifted down by 0.1, with a subtype of it at 0.6; 10 cells of type 1
    q_known0, q_sub, q_known1 = (
        rng.normal(0.7, 0.02, n),
        rng.normal(0.6, 0.02, 100),
        rng.normal(0.5, 0.1, 10),
    )
    maxcos = np.r_[held, known0, known1, sibling, q_known0, q_sub, q_known1]
    pred = np.r_[
        labels,
        np.zeros(n, int),
        np.ones(n, int),
        np.zeros(n, int),
        np.zeros(n + 100, int),
        np.ones(10, int),
    ]
    all_labels = np.r_[labels, np.full(maxcos.size - 2 * n, -1)]
    held_out = np.r_[held, np.full(maxcos.size - 2 * n, np.nan)]
    domain = np.r_[np.zeros(5 * n, int), np.ones(n + 110, int)]
    query = domain == 1
    tau = 0.3  # the in-sample threshold
    thr, info = type_thresholds(maxcos, pred, all_labels, held_out, query, domain, tau, 0.05)
    assert info["type_thresholds"] == pytest.approx(
        [np.quantile(tight, 0.05), np.quantile(loose, 0.05)]
    )
    novel = maxcos < thr
    seg = np.cumsum([2 * n, n, n, n, n, 100, 10])
    k0, k1, sib = novel[seg[0] : seg[1]], novel[seg[1] : seg[2]], novel[seg[2] : seg[3]]
    assert k0.mean() < 0.1 and k1.mean() < 0.1  # about alpha of each type's known cells
    assert sib.mean() > 0.99  # below the tight type's own quantile
    assert (
        maxcos[seg[2] : seg[3]] < np.quantile(held, 0.05)
    ).mean() < 0.01  # a pooled one misses it
    # the query batch: type 0's shift (about -0.1) moves its threshold down, not type 1's
    shift = info["query_shift"][1]
    assert shift[0] == pytest.approx(-0.1, abs=0.02) and shift[1] is None
    assert novel[seg[3] : seg[4]].mean() < 0.1 and novel[seg[4] : seg[5]].mean() > 0.95
    assert (thr[seg[5] :] == tau).all()  # 10 cells of type 1: the in-sample threshold
    # a type with fewer than 1 / alpha held-out cells keeps it everywhere
    few = np.where(all_labels == 1, np.nan, held_out)
    few[np.flatnonzero(all_labels == 1)[:19]] = 0.5
    thr2, info2 = type_thresholds(maxcos, pred, all_labels, few, query, domain, tau, 0.05)
    assert info2["type_thresholds"][1] is None and (thr2[pred == 1] == tau).all()


def test_a_query_shift_that_stands_out_is_noted_with_the_cells_it_keeps_known():
    """A query batch where every cell one known type's head claims is a novel type (the known
    type absent there) looks to the cosines like a batch that shifts that type: the threshold
    follows it, and the cells are kept known. The run cannot tell the two apart, so it says
    which type, which batch and how many cells the shift keeps known that the in-sample
    threshold calls out of distribution; a batch that shifts every type alike is not noted.
    """
    from orca_sc._discover import shift_notes, type_thresholds

    rng = np.random.default_rng(1)
    n = 300
    labels = np.repeat([0, 1, 2], n)
    held = np.r_[rng.normal(0.8, 0.03, n), rng.normal(0.7, 0.03, n), rng.normal(0.75, 0.03, n)]
    # batch 1 (a query): types 1 and 2 shifted by -0.05; type 0 absent, its head claiming 80
    # cells of a novel type at 0.55 (below the in-sample threshold 0.62)
    q1 = rng.normal(0.65, 0.03, n)
    q2 = rng.normal(0.70, 0.03, n)
    nov = rng.normal(0.55, 0.02, 80)
    # batch 2 (a query): every type shifted by -0.1
    r = [rng.normal(m - 0.1, 0.03, n) for m in (0.8, 0.7, 0.75)]
    maxcos = np.concatenate([held, q1, q2, nov, *r])
    pred = np.r_[labels, np.ones(n, int), np.full(n, 2), np.zeros(80, int), labels]
    all_labels = np.r_[labels, np.full(maxcos.size - 3 * n, -1)]
    held_out = np.where(all_labels >= 0, maxcos, np.nan)
    domain = np.r_[np.zeros(3 * n, int), np.ones(2 * n + 80, int), np.full(3 * n, 2)]
    thr, info = type_thresholds(maxcos, pred, all_labels, held_out, domain > 0, domain, 0.62, 0.05)
    novel_cells = slice(5 * n, 5 * n + 80)
    assert (maxcos[novel_cells] >= thr[novel_cells]).mean() > 0.9  # the shift keeps them known
    assert info["shift_kept"][1][0] >= 70
    notes = shift_notes(info, ["reference", "query_a", "query_b"], ["T", "B", "NK"], 20)
    assert len(notes) == 1
    assert "'query_a'" in notes[0] and "'T'" in notes[0] and "absent" in notes[0]
    assert f" {info['shift_kept'][1][0]} of them" in notes[0]


def test_threshold_capped_by_cross_fitted_cosines():
    """The in-sample quantile is capped at the ``ood_max_rate`` quantile of the cross-fitted
    cosines (cells no net trained on), given at least ``1 / ood_max_rate`` of them.
    """
    from orca_sc._discover import ood_threshold

    rng = np.random.default_rng(0)
    fitted = rng.uniform(0.8, 1.0, 400)  # cells the warm-up fitted: close to their heads
    unseen = rng.uniform(0.2, 1.0, 400)  # the same cells in nets that did not see them
    train, none = np.ones(400, bool), np.zeros(400, bool)
    cfg = DiscoveryRules()
    tau, info = ood_threshold(fitted, train, none, cfg)
    assert tau == info["threshold_in_sample"] == pytest.approx(np.quantile(fitted, 0.01))
    assert "threshold_cross_fitted" not in info
    capped, info = ood_threshold(fitted, train, none, cfg, held_out=unseen)
    assert capped == info["threshold_cross_fitted"] == pytest.approx(np.quantile(unseen, 0.1))
    assert capped < tau and info["n_cross_fitted"] == 400
    few = np.full(400, np.nan)
    few[:9] = 0.1  # fewer than 1 / ood_max_rate cells: no cap
    same, info = ood_threshold(fitted, train, none, cfg, held_out=few)
    assert same == tau and info["n_cross_fitted"] == 9 and "threshold_cross_fitted" not in info
    # a cap above the in-sample quantile changes nothing
    high, _ = ood_threshold(fitted, train, none, cfg, held_out=np.full(400, 0.99))
    assert high == tau


def _count_warmup_labels(monkeypatch) -> list[int]:
    """The number of labelled cells of every warm-up the pipeline trains, in order."""
    import orca_sc._crossfit as crossfit
    import orca_sc._pipeline as pipeline

    n_labelled = []
    real = pipeline.fit_warmup

    def spy(cells, labels, *args, **kwargs):
        n_labelled.append(int((labels >= 0).sum()))
        return real(cells, labels, *args, **kwargs)

    monkeypatch.setattr(pipeline, "fit_warmup", spy)  # the main warm-up, the self-check's
    monkeypatch.setattr(crossfit, "fit_warmup", spy)  # the cross-fitted ones
    return n_labelled


def test_small_corners_of_the_sweep():
    """A 150-cell query (~12 cells per type) keeps seen accuracy; two well-separated novel
    types give two clusters; a query with no novel type gives no novel cluster.
    """
    r, _ = _run(_sim_task(n_ref=600, n_query=150), **LABELS_ONLY)
    assert r["seen_acc"] >= 0.8
    two, _ = _run(
        _sim_task(n_ref=400, n_query=400, n_seen=4, n_novel=2, imbalance=1.0), **LABELS_ONLY
    )
    assert two["novel_found"] == 2 and two["novel_acc"] > 0.95
    none, u = _run(_sim_task(n_ref=600, n_query=600, n_novel=0), **LABELS_ONLY)
    assert none["novel_found"] == 0 and u["n_novel"]["found"] == 0


# ------------------------------------------------------------------------------- self-check
def test_self_check_split_hides_whole_types_like_the_query():
    """DTC-style probe: whole known types (with enough cells to form a cluster) are hidden, a
    share of every other type's cells is held out, at least two types stay known and keep a
    training cell; in reference + query data the hidden cells form a batch of their own.
    """
    from orca_sc._discover import self_check_split

    sizes = [40, 30, 30, 20, 20, 20, 20, 5]  # type 7 is too small to hide
    ref = np.repeat(np.arange(8), sizes)
    labels = np.r_[ref, np.full(100, -1)]
    domain = np.r_[np.zeros(ref.size, int), np.ones(100, int)]  # a separate query batch
    for seed in range(5):
        s = self_check_split(labels, domain, type_fraction=0.25, known_fraction=0.2, seed=seed)
        assert s.held_types.size == 2 and 7 not in s.held_types
        np.testing.assert_array_equal(s.novel, np.isin(labels, s.held_types))
        assert not (s.known & s.novel).any() and not s.known[labels < 0].any()
        kept = np.setdiff1d(np.arange(8), s.held_types)
        for k in kept:  # ~20% held out, and every kept type still trains
            n_held = int((s.known & (labels == k)).sum())
            assert n_held == min(round(0.2 * sizes[k]), sizes[k] - 1)
        train = s.labels >= 0
        assert np.array_equal(train, (labels >= 0) & ~s.novel & ~s.known)
        # kept types are recoded 0..5, in order
        np.testing.assert_array_equal(np.unique(s.labels[train]), np.arange(6))
        np.testing.assert_array_equal(kept[s.labels[train]], labels[train])
        assert (s.domain[s.novel | s.known] == 2).all() and (s.domain[~(s.novel | s.known)] == domain[~(s.novel | s.known)]).all()  # fmt: skip
    # one batch with labelled and unlabelled cells: the hidden cells stay in it
    s = self_check_split(labels, np.zeros_like(labels), seed=0)
    assert (s.domain == 0).all()
    assert self_check_split(np.repeat([0, 1], 30), np.zeros(60, int)) is None  # 2 types
    assert self_check_split(np.repeat([0, 1, 2], 5), np.zeros(15, int)) is None  # all tiny


def test_youden_threshold_is_the_best_cut():
    from orca_sc._discover import youden_threshold

    t, j = youden_threshold(np.array([0.1, 0.2, 0.3]), np.array([0.25, 0.5, 0.6, 0.7]))
    assert t == pytest.approx(0.4) and j == pytest.approx(0.75)
    t, j = youden_threshold(np.array([0.1, 0.2]), np.array([0.5, 0.6]))
    assert 0.2 < t < 0.5 and j == 1.0


def test_self_check_report_scores_the_hidden_types():
    """Two hidden types: one in its own candidate cluster, one split between a cluster of its
    own and known cells; held-out known cells: one of four in a candidate cluster.
    """
    from orca_sc._discover import SelfCheckSplit, self_check_report

    labels = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, -1, -1])
    novel = np.isin(labels, [1, 2])
    known = labels == 0
    split = SelfCheckSplit(np.array([1, 2]), novel, known, np.where(novel | known, -1, labels),
                           np.zeros_like(labels))  # fmt: skip
    # cluster 2 also holds two unlabelled cells (of the hidden type, in one batch): it is
    # judged on the cells whose type is known
    assign = np.array([0, -1, -1, -1, 1, 1, 1, 1, 2, 2, -1, -1, 2, 2])
    maxcos = np.array([0.5, 0.6, 0.7, 0.8, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.55, 0.65, 0, 0])
    r = self_check_report(assign, maxcos, 0.4, labels, split, ["a", "b", "c"])
    assert r["hidden_types"] == ["b", "c"]
    assert r["novel_called"] == pytest.approx(6 / 8)
    assert r["known_called_novel"] == pytest.approx(1 / 4)
    assert r["hidden_accuracy"] == pytest.approx(6 / 8)
    assert r["hidden_clusters_found"] == 2 and r["hidden_types_true"] == 2
    assert r["novel_below_threshold"] == pytest.approx(6 / 8)
    assert r["known_below_threshold"] == 0.0


def test_self_check_reports_in_uns_and_leaves_the_annotation_alone(monkeypatch, tmp_path):
    """``self_check=True`` trains a second warm-up without the hidden types and held-out cells,
    reports how the rules did on them (on well-separated simulated types: nearly all hidden-type
    cells called novel, few held-out known cells), writes it to h5ad, and changes nothing else.
    """
    import anndata as ad

    n_labelled = _count_warmup_labels(monkeypatch)
    task = _sim_task(n_ref=600, n_query=400)
    off, u_off = _run(task, novelty_folds=0)  # the novelty test's warm-ups are counted elsewhere
    on, q = _annotated(task, self_check=True, novelty_folds=0)
    u = q.uns["orca"]
    assert n_labelled[1] == n_labelled[0] and n_labelled[2] < n_labelled[0]
    assert on == off
    check = u["self_check"]
    assert 1 <= len(check["hidden_types"]) <= len(u["seen_classes"]) - 2
    assert set(check["hidden_types"]) <= set(u["seen_classes"])
    assert check["novel_called"] >= 0.8 and check["known_called_novel"] <= 0.1
    assert check["hidden_clusters_found"] >= 1
    assert not check["notes"]
    # a 200-cell reference on 1,000 genes: the warm-up memorises its few labels and discovery
    # puts known-type cells into novel clusters; the self-check sees it on the reference and
    # says so (its held-out known-type cells: 100% in novel clusters). Naming then reports some
    # of those clusters as their known type (the merge's correlation corrected for the 20-odd
    # cells of each reference type), and training keeps most query cells on their known heads
    # (pairs in the PCA), so the run calls fewer (7%) than the check measured
    few, u_few = _run(
        _sim_task(n_ref=200, n_query=150, n_genes=1000), self_check=True, **LABELS_ONLY
    )
    assert 0 < few["known_called_novel"] < u_few["self_check"]["known_called_novel"]
    assert u_few["merged_into_known"]["type"]
    assert u_few["self_check"]["known_called_novel"] > 0.3
    assert any("held-out known-type cells into novel" in n for n in u_few["self_check"]["notes"])
    q.write_h5ad(tmp_path / "q.h5ad")
    back = ad.read_h5ad(tmp_path / "q.h5ad").uns["orca"]["self_check"]
    assert list(back["hidden_types"]) == check["hidden_types"]
    assert float(back["known_called_novel"]) == check["known_called_novel"]


def test_discovery_on_a_device_finds_the_neighbours_and_components_of_the_cpu_path():
    """The torch path of discovery's arithmetic (a GPU run's; forced here on the CPU) gives
    scikit-learn's exact neighbours, and a PCA whose leading components are the CPU PCA's (up to
    sign), for the log values and the Pearson residuals; it is used only inside ``on_device``.
    """
    from orca_sc._discover import PearsonResiduals, compute

    rng = np.random.default_rng(0)
    emb = rng.normal(size=(1500, 12)).astype(np.float32)
    cpu = compute.kneighbors(emb, 15)
    with compute.on_device(torch.device("cpu"), force=True):
        assert compute.device() is not None
        dev, dev_q = compute.kneighbors(emb, 15), compute.kneighbors(emb, 16, emb[:300])
    assert compute.device() is None
    np.testing.assert_array_equal(dev, cpu)
    np.testing.assert_array_equal(dev_q, compute.kneighbors(emb, 16, emb[:300]))
    assert (dev != np.arange(emb.shape[0])[:, None]).all()  # no cell is its own neighbour
    with compute.on_device(torch.device("cpu")):  # not a GPU, not forced: the CPU path
        assert compute.device() is None

    a = orca_sc.datasets.simulate(2000, 400, 6, library_size=800, seed=2)
    totals = np.asarray(a.X.sum(axis=1)).ravel()
    X = sp.csr_matrix(a.X, dtype=np.float32)
    X = X.multiply(1e4 / totals[:, None]).tocsr()
    X.data = np.log1p(X.data).astype(np.float32)
    dom = (np.arange(X.shape[0]) % 2).astype(np.int64)
    scale = np.ones((2, 400), np.float32)
    offset = rng.normal(scale=0.1, size=(2, 400)).astype(np.float32)
    rows = np.arange(0, 2000, 2)
    for res in (None, PearsonResiduals.fit(X, dom, totals, 1e4)):
        ref = pca_embedding(X, dom, scale, offset, n_comps=8, rows=rows, residuals=res)
        with compute.on_device(torch.device("cpu"), force=True):
            got = pca_embedding(X, dom, scale, offset, n_comps=8, rows=rows, residuals=res)
        assert got.shape == ref.shape == (rows.size, 8) and got.dtype == np.float32
        corr = [abs(np.corrcoef(ref[:, i], got[:, i])[0, 1]) for i in range(4)]
        assert min(corr) > 0.999, corr


def test_a_set_of_points_is_searched_once_per_neighbour_count_within_a_run(monkeypatch):
    """Inside ``neighbours_once`` (a run's duration) the neighbours of a set of points among
    themselves are searched once per count and the same answer comes back (a copy: a caller's
    write does not reach the next one); a search with queries, other points or another count is
    its own; outside it every call searches.
    """
    from orca_sc._discover import compute

    rng = np.random.default_rng(0)
    emb = rng.normal(size=(800, 10)).astype(np.float32)
    other = emb + np.float32(1e-3) * rng.normal(size=emb.shape).astype(np.float32)
    searched = []
    real = compute._kneighbors
    monkeypatch.setattr(compute, "_kneighbors", lambda e, k, q: searched.append(k) or real(e, k, q))
    fresh = compute.kneighbors(emb, 15)
    with compute.neighbours_once():
        first = compute.kneighbors(emb, 15)
        first[:] = -1  # the caller's copy
        again = compute.kneighbors(emb.copy(), 15)
        compute.kneighbors(emb, 20)
        compute.kneighbors(other, 15)
        compute.kneighbors(emb, 15, emb[:50])
        compute.kneighbors(emb, 15, emb[:50])
    compute.kneighbors(emb, 15)
    np.testing.assert_array_equal(again, fresh)
    assert searched == [15, 15, 20, 15, 15, 15, 15]


def test_a_run_with_discovery_on_a_device_finds_the_novel_types(small_sim):
    """A whole run with discovery's arithmetic on the torch path (forced on the CPU, as on a
    GPU) finds both novel types of the small simulation, as the CPU path does.
    """
    from orca_sc._discover import compute

    with compute.on_device(torch.device("cpu"), force=True):
        orca_sc.tl.annotate(small_sim, labels_key="lab", **FAST)
    truth = small_sim.obs["cell_type"].astype(str)
    novel = small_sim.obs["orca_novel"]
    for t in ("type_3", "type_4"):
        assert novel[truth == t].notna().mean() > 0.9
    assert novel[truth.isin(["type_0", "type_1", "type_2"])].notna().mean() < 0.05
    assert novel.dropna().nunique() == 2


def test_conformal_query_vote_does_not_move_with_the_number_of_cells():
    """The conformal vote reads each query cell's score against the cross-fitted cosines of the
    known type that claims it: a cluster of known cells (scores drawn like the type's unseen
    labelled cells, shifted down by the batch) is never a candidate, however many cells it has,
    and a cluster that scores below them with a medium effect is one at 100 cells as at 50,000.
    The share vote with a threshold fixed at the 5% quantile flags 5% of the known cells and
    about a fifth of the novel ones: below its majority, and its enrichment depends on how many
    novel cells the batch holds.
    """
    from orca_sc._discover import query_pvalues
    from orca_sc._discover.query import QUERY_MEAN_P, conformal_vote

    rng = np.random.default_rng(1)
    held = rng.normal(0.35, 0.1, 600)  # type 0's cross-fitted cosines
    labels = np.r_[np.zeros(600, int), np.full(2 * 50_000, -1)]
    for n in (100, 2_000, 50_000):
        known = rng.normal(0.30, 0.1, n)  # the batch shifts type 0 down by 0.05
        novel = rng.normal(0.22, 0.1, n)  # a novel type type 0's head claims
        maxcos = np.r_[held, known, novel, np.zeros(2 * (50_000 - n))]
        held_out = np.r_[held, np.full(maxcos.size - 600, np.nan)]
        domain = np.r_[np.zeros(600, int), np.ones(maxcos.size - 600, int)]
        cells = np.arange(600, 600 + 2 * n)
        p = query_pvalues(maxcos, np.zeros(maxcos.size, int), labels, held_out, domain, cells,
                          {1: [-0.05]}, 20)  # fmt: skip
        assert np.isnan(p[:600]).all() and np.isfinite(p[cells]).all()
        assert p[cells[:n]].mean() == pytest.approx(0.5, abs=0.1 if n == 100 else 0.03)
        assert not conformal_vote(p[cells[:n]], 10)[0]
        take, mean = conformal_vote(p[cells[n:]], 10)
        assert take and mean <= QUERY_MEAN_P
        # the share vote at the 5% quantile of the held-out cosines
        flagged = maxcos[cells] < np.quantile(held, 0.05) - 0.05
        assert flagged[:n].mean() < 0.12 and flagged[n:].mean() < 0.5


def test_conformal_query_vote_needs_an_effect_and_enough_cells():
    """A cluster slightly below its type (mean p 0.45) is not a candidate even at 50,000 cells,
    where a test alone would call it; three cells at p 0.2 are not one either: the test cannot
    support the call (the same scores over 40 cells can).
    """
    from orca_sc._discover.query import conformal_vote

    rng = np.random.default_rng(2)
    slight = np.clip(rng.uniform(0, 1, 50_000) - 0.05, 0.001, 1)
    take, mean = conformal_vote(slight, 10)
    assert not take and mean == pytest.approx(0.45, abs=0.01)
    assert not conformal_vote(np.full(3, 0.2), 10)[0]
    assert conformal_vote(np.full(40, 0.2), 10)[0]


def test_contrast_vote_compares_a_cluster_with_its_type_in_the_same_batch():
    """The contrast vote asks whether a cluster's cells score below the batch's other cells of
    the type that claims them: a novel type under a known type's head does (its p-values low,
    the type's own cells uniform); one half of a known type shifted as a whole does not (both
    halves alike); a type with no other cells in the batch cannot be compared, so no; and a
    small effect is not enough however many cells show it.
    """
    from orca_sc._discover.query import QUERY_MEAN_P, contrast_vote

    rng = np.random.default_rng(3)
    claimed = np.zeros(500, int)
    inside = np.r_[np.ones(100, bool), np.zeros(400, bool)]
    novel = np.r_[rng.uniform(0, 0.4, 100), rng.uniform(0, 1, 400)]
    take, auc = contrast_vote(novel, claimed, inside, ~inside, 10, 20)
    assert take and auc <= QUERY_MEAN_P
    shifted = rng.uniform(0, 0.4, 500)  # the whole type scores low: halves alike
    take, auc = contrast_vote(shifted, claimed, inside, ~inside, 10, 20)
    assert not take and auc == pytest.approx(0.5, abs=0.1)
    alone = np.r_[np.zeros(100, int), np.ones(400, int)]  # type 0 only in the cluster
    assert contrast_vote(novel, alone, inside, ~inside, 10, 20) == (False, None)
    big = np.r_[np.ones(20_000, bool), np.zeros(20_000, bool)]
    slight = np.r_[rng.uniform(0, 0.9, 20_000), rng.uniform(0, 1, 20_000)]
    take, auc = contrast_vote(slight, np.zeros(40_000, int), big, ~big, 10, 20)
    assert not take and auc == pytest.approx(0.45, abs=0.02)


def test_contrast_query_vote_leaves_a_type_the_batch_shifts_as_a_whole():
    """With each cell's claiming type, the conformal vote also needs the cluster to score below
    the batch's other cells of that type, in the clusters the conformal vote leaves: two novel
    clusters that type 0's head claims beside type 0's own cells are both taken (neither is the
    other's comparison, though the larger would hide the smaller); a known type the batch
    shifts as a whole (every cell low against its labelled cells, no other cell of it in the
    batch) is not taken, though the conformal vote alone flags it. The comparison is
    recorded.
    """
    from orca_sc._discover import query_ood_clusters
    from orca_sc._discover.query import contrast_vote

    rng = np.random.default_rng(0)
    n = {"N": 80, "M": 400, "K": 150, "W": 120}
    centers = {t: 10.0 * np.eye(4)[i] for i, t in enumerate(n)}
    emb = np.vstack([centers[t] + rng.normal(0, 1, (n[t], 4)) for t in n])
    truth = np.repeat(list(n), list(n.values()))
    p = np.where(truth == "K", rng.uniform(0, 1, truth.size), rng.uniform(0, 0.4, truth.size))
    claimed = np.where(truth == "W", 1, 0)
    ood = rng.random(truth.size) < 0.05  # the share vote takes nothing
    args = (ood, np.arange(truth.size), np.zeros(truth.size, int), lambda idx: emb[idx])
    votes: list[dict] = []
    contrast = query_ood_clusters(*args, resolution=0.2, pvalues=p, claimed=claimed, votes=votes)
    assert sorted(pd.Series(truth[g]).mode()[0] for g in contrast) == ["M", "N"]
    compared = [v["contrast_auc"] for v in votes if v["contrast_auc"] is not None]
    assert len(votes) == 4 and len(compared) == 2 and max(compared) < 0.36
    w = next(v for v in votes if v["type"] == 1)
    assert w["mean_p"] < 0.36 and not w["candidate"]  # W: low as a whole, alone of its type
    # against every other cell of type 0, the 80-cell cluster would not be taken
    assert not contrast_vote(p, claimed, truth == "N", truth != "N", 4, 20)[0]


def test_query_votes_take_a_cluster_either_vote_takes():
    """A cluster is a candidate by its share of out-of-distribution cells or, where its cells
    have p-values, by the contrast vote: a novel cluster with few flagged cells but low
    p-values (below the cells of the type that claims it) is taken, a cluster of flagged cells
    without p-values (its type has too few cross-fitted cells) is taken, a known cluster with
    uniform p-values and few flagged cells is not. Every vote is recorded.
    """
    from orca_sc._discover import query_ood_clusters

    rng = np.random.default_rng(0)
    n = {"N": 80, "K": 300, "S": 60}
    centers = {t: 10.0 * np.eye(3)[i] for i, t in enumerate(n)}
    emb = np.vstack([centers[t] + rng.normal(0, 1, (n[t], 3)) for t in n])
    truth = np.repeat(list(n), list(n.values()))
    p = np.where(truth == "N", rng.uniform(0, 0.4, truth.size), rng.uniform(0, 1, truth.size))
    p[truth == "S"] = np.nan
    ood = rng.random(truth.size) < np.where(truth == "N", 0.2, np.where(truth == "K", 0.03, 0.7))
    args = (ood, np.arange(truth.size), np.zeros(truth.size, int), lambda idx: emb[idx])
    votes: list[dict] = []
    claimed = np.zeros(truth.size, int)  # one head claims every cell
    groups = query_ood_clusters(*args, resolution=0.2, pvalues=p, claimed=claimed, votes=votes)
    assert sorted(pd.Series(truth[g]).mode()[0] for g in groups) == ["N", "S"]
    assert len(votes) == 3 and sum(v["candidate"] for v in votes) == 2
    assert sorted(v["mean_p"] is None for v in votes) == [False, False, True]
    # the share vote alone misses N (20% flagged, below 2.5 times the batch's 15%)
    share = query_ood_clusters(*args, resolution=0.2)
    assert [pd.Series(truth[g]).mode()[0] for g in share] == ["S"]


def _four_clusters(n: dict[str, int], rng: np.random.Generator):
    """Four well-separated clusters of a query batch (``n``: cells per cluster name): their
    4-d embedding, each cell's cluster name and uniform p-values (those of known-type cells).
    """
    centers = {t: 10.0 * np.eye(4)[i] for i, t in enumerate(n)}
    emb = np.vstack([centers[t] + rng.normal(0, 1, (n[t], 4)) for t in n])
    truth = np.repeat(list(n), list(n.values()))
    return emb, truth, rng.uniform(0, 1, truth.size)


def test_share_vote_needs_the_cells_to_score_low_as_a_whole():
    """A known type whose cosines the query spreads (as a condition program does) fills the tail
    below the threshold: 40% of its cells are flagged, enough for the share vote, while its
    cells as a whole score like the labelled cells (mean p about 1/2). With the share vote's
    test it is no candidate; a novel cluster (flagged, low p-values) and a flagged cluster
    without p-values (nothing to test) still are. Each share vote's test is recorded.
    """
    from orca_sc._discover import query_ood_clusters

    rng = np.random.default_rng(1)
    n = {"N": 80, "K": 1000, "W": 120, "S": 60}
    emb, truth, p = _four_clusters(n, rng)
    p[truth == "N"] = rng.uniform(0, 0.05, n["N"])
    wide = rng.random(truth.size) < 0.4  # W: a widened spread, 40% of the cells in the tail
    w = truth == "W"
    p[w] = np.where(wide[w], rng.uniform(0, 0.05, w.sum()), rng.uniform(0.7, 1, w.sum()))
    p[truth == "S"] = np.nan
    ood = (p <= 0.05) | ((truth == "S") & (rng.random(truth.size) < 0.7))
    args = (ood, np.arange(truth.size), np.zeros(truth.size, int), lambda idx: emb[idx])
    mode = lambda groups: sorted(pd.Series(truth[g]).mode()[0] for g in groups)  # noqa: E731
    kw = {"resolution": 0.2, "pvalues": p, "min_fraction": 0.5, "min_enrichment": 2.0,
          "claimed": np.zeros(truth.size, int)}  # fmt: skip
    assert mode(query_ood_clusters(*args, **kw)) == ["N", "S", "W"]
    votes: list[dict] = []
    assert mode(query_ood_clusters(*args, **kw, share_level=0.05, votes=votes)) == ["N", "S"]
    tested = {v["cells"]: v["share_test_p"] for v in votes}
    assert tested[n["W"]] > 0.05 and tested[n["N"]] < 1e-6 and tested[n["S"]] is None
    assert tested[n["K"]] is None  # the share vote did not take K: nothing to test


def test_mean_p_test_holds_its_level_and_reads_few_p_values():
    """The test of a cluster's mean conformal p-value is exact below 20 values (Irwin-Hall): for
    uniform p-values (cells exchangeable with the labelled cells) it rejects at 0.05 about 5% of
    the time at every size, and its normal approximation from 20 values on agrees with it.
    Conformal p-values (1 + k) / (m + 1) are super-uniform: the test rejects them less often.
    """
    from scipy.stats import irwinhall

    from orca_sc._discover.query import MEAN_TEST_NORMAL_FROM, mean_p_below_half

    rng = np.random.default_rng(0)
    for n in (2, 7, 19, 20, 40):
        draws = rng.uniform(0, 1, (3000, n))
        rate = np.mean([mean_p_below_half(p) <= 0.05 for p in draws])
        assert abs(rate - 0.05) < 0.014, (n, rate)  # 3.5 binomial SE at 3,000 draws
        conformal = (1 + rng.integers(0, 21, (3000, n))) / 21  # m = 20 held-out cosines
        assert np.mean([mean_p_below_half(p) <= 0.05 for p in conformal]) <= rate + 0.014
    p = rng.uniform(0, 0.6, MEAN_TEST_NORMAL_FROM)
    assert abs(mean_p_below_half(p) - irwinhall(p.size).cdf(p.sum())) < 0.01
    assert mean_p_below_half(np.full(5, 0.1)) < 0.001  # 5 novel cells' p-values: taken
    assert mean_p_below_half(np.full(5, 0.5)) > 0.4


def test_share_vote_test_reads_clusters_with_few_p_values():
    """A flagged cluster whose type has few labelled cells holds few cells with a p-value (here
    8 of 60). From :data:`SHARE_TEST_MIN_VALUES` on, the share vote's test reads them: a
    known-type cluster whose 8 p-values average about 1/2 is left out, a novel cluster with 8 low
    ones stays; a cluster with 3 is not tested (the test could not confirm a novel one).
    """
    from orca_sc._discover import query_ood_clusters
    from orca_sc._discover.query import SHARE_TEST_MIN_VALUES

    assert SHARE_TEST_MIN_VALUES <= 8
    rng = np.random.default_rng(2)
    n = {"N": 60, "K": 1000, "W": 60, "F": 60}
    emb, truth, p = _four_clusters(n, rng)
    for t, k, lo, hi in (("N", 8, 0.0, 0.1), ("W", 8, 0.3, 0.8), ("F", 3, 0.3, 0.8)):
        rows = np.flatnonzero(truth == t)
        p[rows] = np.nan
        p[rows[:k]] = rng.uniform(lo, hi, k)
    ood = np.where(np.isin(truth, ["N", "W", "F"]), rng.random(truth.size) < 0.8,
                   rng.random(truth.size) < 0.02)  # fmt: skip
    args = (ood, np.arange(truth.size), np.zeros(truth.size, int), lambda idx: emb[idx])
    kw = {"resolution": 0.2, "pvalues": p, "min_fraction": 0.5, "min_enrichment": 2.0,
          "claimed": np.zeros(truth.size, int)}  # fmt: skip
    votes: list[dict] = []
    found = query_ood_clusters(*args, **kw, share_level=0.05, votes=votes)
    assert sorted(pd.Series(truth[g]).mode()[0] for g in found) == ["F", "N"]
    assert [v["share"] for v in votes if v["cells"] == 60] == [True] * 3
    assert [v["share"] for v in votes if v["cells"] == 1000] == [False]
    tested = sorted(v["share_test_p"] for v in votes if v["share_test_p"] is not None)
    assert len(tested) == 2 and tested[0] < 0.001 < 0.05 < tested[1]
    # the mean p-value is recorded wherever the test could read one (the note names it)
    assert [v["share"] for v in votes if v["mean_p"] is None] == [True]
