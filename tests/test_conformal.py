"""The conformal novelty test: p-values that keep their level, Benjamini-Hochberg, per-cluster
support, and the columns a run writes.
"""

import numpy as np
import pytest
from scipy.stats import false_discovery_control

import orca_sc
from orca_sc._conformal import (
    MIN_TAIL_CELLS,
    CrossConformal,
    benjamini_hochberg,
    cell_calls,
    cluster_support,
    fold_ids,
    premise_check,
)
from tests.conftest import FAST


def test_folds_are_stratified_and_balanced():
    labels = np.repeat([0, 1, 2, -1], [7, 12, 3, 5])
    folds = fold_ids(labels, 5, seed=1)
    assert (folds[labels < 0] == -1).all() and (folds[labels >= 0] >= 0).all()
    sizes = np.bincount(folds[folds >= 0], minlength=5)
    assert sizes.max() - sizes.min() <= 1  # 22 cells: 4 or 5 per fold
    for k in (0, 1, 2):  # each type spread over min(its cells, folds) folds
        assert np.unique(folds[labels == k]).size == min((labels == k).sum(), 5)


def test_benjamini_hochberg_matches_scipy():
    p = np.random.default_rng(0).random(200) ** 3
    np.testing.assert_allclose(benjamini_hochberg(p), false_discovery_control(p))
    assert benjamini_hochberg(np.array([])).size == 0


def test_cross_conformal_pvalues_keep_their_level_under_exchangeability():
    """Calibration and test scores from one distribution, folds as in a run (a test cell is
    scored by every fold's net: its own score plus a little noise per fold): over many
    repetitions the share of test cells with p <= a is at most a (+ Monte Carlo error), for
    every a, and not far below it; a shifted test population gets small p-values.
    """
    rng = np.random.default_rng(0)
    levels = np.array([0.01, 0.05, 0.1, 0.2])
    below = np.zeros(levels.size)
    reps, n_test = 300, 50
    for _ in range(reps):
        cc = CrossConformal(n_test)
        test = rng.normal(size=n_test)
        for _f in range(5):
            cc.add(rng.normal(size=8), test + rng.normal(scale=0.1, size=n_test))
        below += (cc.pvalues()[:, None] <= levels).mean(axis=0)
    rate = below / reps
    assert (rate <= levels + 0.01).all(), rate
    assert (rate >= levels - 0.03).all(), rate  # not vacuous: close to the level
    cc = CrossConformal(20)
    for _f in range(5):
        cc.add(rng.normal(size=40), rng.normal(loc=4.0, size=20))
    assert np.median(cc.pvalues()) < 0.02


def test_knn_score_is_the_exact_mean_distance_to_the_nearest_reference_cells():
    """The score found as blocks of cosines and their top k (blocks smaller than the query, so
    that several are joined) is scikit-learn's exact brute-force neighbours' mean cosine distance;
    k is capped at the number of reference cells.
    """
    import torch
    from sklearn.neighbors import NearestNeighbors

    from orca_sc import _cells as _train

    rng = np.random.default_rng(0)
    ref, cells = (rng.standard_normal((n, 16)).astype(np.float32) for n in (300, 1000))
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    cells /= np.linalg.norm(cells, axis=1, keepdims=True)
    dist = NearestNeighbors(n_neighbors=10).fit(ref).kneighbors(cells)[0]
    expected = (dist.astype(np.float64) ** 2 / 2).mean(axis=1)  # |a - b|^2 / 2 = 1 - cos
    cpu = torch.device("cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_train, "KNN_BLOCK_VALUES", 300 * 128)  # blocks of 128 cells
        np.testing.assert_allclose(
            _train.knn_mean_distance(ref, cells, 10, cpu), expected, atol=1e-6
        )
    few = _train.knn_mean_distance(ref[:3], cells, 10, cpu)
    np.testing.assert_allclose(few, 1 - (cells @ ref[:3].T).mean(axis=1), atol=1e-6)


def test_cluster_support_verdicts():
    rng = np.random.default_rng(0)
    p = np.concatenate([rng.random(300), rng.random(60) * 0.04, rng.random(60)])
    clusters = np.repeat([-1, 0, 1], [300, 60, 60])
    table, notes = cluster_support(p, clusters, ["novel_1", "novel_2"], 0.05, 500)
    assert table["supported"] == ["significant", "not significant"]
    assert table["n_cells"] == [60, 60] and table["share_p_below_alpha"][0] == 1.0
    assert any("novel_2" in n for n in notes)
    # where the batch's known cells score unlike the reference too (a quarter of them p <= 0.05),
    # a cluster is compared with them: 60 of 60 cells still stand out, 18 of 60 do not
    shifted = np.concatenate([p[:360], np.where(rng.random(60) < 0.3, 0.01, 0.5)])
    base = (75, 300)
    table, _ = cluster_support(shifted, clusters, ["novel_1", "novel_2"], 0.05, 500, [base] * 2)
    assert table["supported"] == ["significant", "not significant"]
    assert table["compared_with"] == ["known cells of its batch"] * 2
    plain, _ = cluster_support(shifted, clusters, ["novel_1", "novel_2"], 0.05, 500)
    assert plain["supported"] == ["significant", "significant"]  # against alpha: both
    assert plain["compared_with"] == ["alpha", "alpha"]
    few = int(MIN_TAIL_CELLS / 0.05) - 1  # too few labelled cells for the tail at alpha
    table, notes = cluster_support(p, clusters, ["novel_1", "novel_2"], 0.05, few)
    assert table["supported"] == ["cannot tell", "cannot tell"]
    assert any("cannot say" in n for n in notes)


def _conformal_p(calibration, test, rng):
    """Cross-conformal p-values of ``test`` against ``calibration`` dealt into 5 folds, a test
    cell scored by every fold's net (its score plus a little noise per fold).
    """
    cc = CrossConformal(test.size)
    for part in np.array_split(rng.permutation(calibration), 5):
        cc.add(part, test + rng.normal(scale=0.05, size=test.size))
    return cc.pvalues()


def _rare_type_scores(rng):
    """500 labelled cells' scores, 3% of them a rare type scoring high, and 1,000 query cells':
    800 like the bulk, 200 new ones scoring between the bulk and the rare type.
    """
    bulk, rare = rng.normal(size=485), rng.normal(loc=6.0, size=15)
    query = np.concatenate([rng.normal(size=800), rng.normal(loc=3.5, scale=0.3, size=200)])
    return bulk, rare, query


def test_cell_calls_says_when_q_values_cannot_single_out_what_p_values_show():
    """500 labelled cells, 3% of them a rare type scoring high (as labelled cells of a type
    with 2-4 cells do); 800 query cells like the bulk and 200 new ones scoring between the
    bulk and the rare type: the p-values show the excess, Benjamini-Hochberg calls no cell, and
    the note says so. Without the rare type the new cells outscore every labelled cell and are
    called; with no new cells there is no excess: no note either way.
    """
    rng = np.random.default_rng(0)
    bulk, rare, query = _rare_type_scores(rng)
    p = _conformal_p(np.concatenate([bulk, rare]), query, rng)
    q = benjamini_hochberg(p)
    record, notes = cell_calls(p, q, 0.05, 500)
    assert record["n_called"] == 0 and record["smallest_qvalue"] > 0.05
    assert np.mean(p[800:] <= 0.05) > 0.9  # the p-values see the new cells ...
    assert len(notes) == 1 and "No cell is novel on its own" in notes[0].line  # ... and it says so
    p = _conformal_p(bulk, query, rng)
    record, notes = cell_calls(p, benjamini_hochberg(p), 0.05, 485)
    assert record["n_called"] >= 150 and not notes
    p = _conformal_p(np.concatenate([bulk, rare]), query[:800], rng)
    record, notes = cell_calls(p, benjamini_hochberg(p), 0.05, 500)
    assert record["n_called"] == 0 and not notes
    # too few calibration cells for the tail: the clusters' test says 'cannot tell' instead
    enough = int(MIN_TAIL_CELLS / 0.05)
    assert cell_calls(np.full(100, 0.02), np.full(100, 0.2), 0.05, enough)[1]
    assert not cell_calls(np.full(100, 0.02), np.full(100, 0.2), 0.05, enough - 1)[1]


def test_the_run_notes_uncalled_cells_only_where_the_premise_holds():
    """The record of the novelty test (``_annotation.novelty_test``): with the p-values of the
    test above in one query batch the cell-calls note is among its notes; where the query's
    known-labelled cells score low too (the premise fails) the premise's note speaks instead.
    """
    from orca_sc import DiscoveryConfig
    from orca_sc._annotation import novelty_test

    rng = np.random.default_rng(1)
    bulk, rare, query = _rare_type_scores(rng)
    p_query = _conformal_p(np.concatenate([bulk, rare]), query, rng)
    labeled = np.repeat([True, False], [500, 1000])
    pvalues = np.concatenate([np.full(500, np.nan), p_query])
    labels = np.array(["a"] * 500 + ["a"] * 800 + ["novel_1"] * 200, dtype=object)
    test = novelty_test(pvalues, labels, labeled, ["novel_1"], DiscoveryConfig())
    assert test.record["n_called"] == 0 and test.record["premise"]["holds"] == ["holds"]
    assert any("on its own" in line for line in test.record["note_lines"])
    shifted = pvalues.copy()
    shifted[500:800] = rng.uniform(0.02, 0.05, 300)  # 300 of the 800 known-labelled cells
    test = novelty_test(shifted, labels, labeled, ["novel_1"], DiscoveryConfig())
    assert test.record["premise"]["holds"] == ["fails"] and test.record["n_called"] == 0
    assert not any("on its own" in line for line in test.record["note_lines"])


def test_premise_check_fails_only_where_known_cells_score_below_the_reference():
    """Batch 'a': cells labelled known with uniform p-values (exchangeable: the premise holds);
    batch 'b': a fifth of them with p below alpha (shifted: it fails); cells called novel are
    left out, and too few calibration cells make it 'cannot tell'.
    """
    rng = np.random.default_rng(0)
    n = 400
    p = np.concatenate([rng.random(n), np.where(rng.random(n) < 0.2, 0.01, rng.random(n)),
                        np.full(50, 0.001)])  # fmt: skip
    batch = np.repeat([0, 1, 0], [n, n, 50])
    known = np.repeat([True, True, False], [n, n, 50])  # the last 50: called novel
    table, notes, failing = premise_check(p, known, batch, ["a", "b"], 0.05, 500)
    assert table["batch"] == ["a", "b"] and table["n_known"] == [n, n]
    k_b = int((p[n : 2 * n] <= 0.05).sum())
    assert failing == {1: (k_b, n)}  # the counts a cluster of 'b' is compared with
    assert table["holds"] == ["holds", "fails"]
    assert table["share_p_below_alpha"][1] > 0.15 and table["pvalue"][1] < 1e-6
    assert len(notes) == 1 and "'b'" in notes[0] and "'a'" not in notes[0]
    few = int(MIN_TAIL_CELLS / 0.05) - 1
    assert premise_check(p, known, batch, ["a", "b"], 0.05, few)[0]["holds"] == ["cannot tell"] * 2


def _same_types_split(per_type, seed=0):
    """Reference and query drawn from one simulated batch and the same 6 types: reference =
    ``per_type`` cells of each type (None: a random half), query = the rest.
    """
    a = orca_sc.datasets.simulate(1500, 400, 6, markers_per_type=30, seed=seed)
    rng = np.random.default_rng(seed)
    t = a.obs["cell_type"].astype(str).to_numpy()
    if per_type is None:
        ref = rng.random(a.n_obs) < 0.5
    else:
        ref = np.zeros(a.n_obs, dtype=bool)
        for k in np.unique(t):
            ref[rng.choice(np.flatnonzero(t == k), per_type, replace=False)] = True
    return a[ref].copy(), a[~ref].copy()


@pytest.mark.parametrize("per_type", [None, 5])
def test_known_types_get_p_below_alpha_at_most_alpha(per_type):
    """The issue's test: a query of the reference's own types (exchangeable cells) has at most
    a share alpha of cells with p <= alpha, plus a stated tolerance: 2.5 standard deviations of
    the share given one calibration set (sqrt(a (1 - a) / (n + 1)), n labelled cells) and 0.01
    for the query's own draw. With 5 labelled cells per type that is 30 calibration cells.
    """
    ref, query = _same_types_split(per_type)
    alpha = 0.05
    out = orca_sc.tl.annotate(query, ref, labels_key="cell_type", copy=True, seed=0, **FAST)
    p = out.obs["orca_novelty_pvalue"].to_numpy()
    assert np.isfinite(p).all() and ((p > 0) & (p <= 1)).all()
    n = ref.n_obs
    tol = 2.5 * np.sqrt(alpha * (1 - alpha) / (n + 1)) + 0.01
    assert np.mean(p <= alpha) <= alpha + tol, (np.mean(p <= alpha), alpha + tol)
    test = out.uns["orca"]["novelty_test"]
    assert test["alpha"] == alpha and test["n_calibration"] == n and test["folds"] == 5
    # the run's own check of that premise agrees (its one batch of unlabelled cells; with 30
    # calibration cells the tail is too thin to tell)
    assert test["premise"]["holds"] == ["holds" if per_type is None else "cannot tell"]
    assert not any("premise" in x for x in test["notes"])
    q = out.obs["orca_novelty_qvalue"].to_numpy()
    assert (q >= p - 1e-7).all()


def test_a_query_shifted_type_by_type_fails_the_premise_and_is_told_so(tmp_path):
    """No novel type, but the query's types each shifted their own way (a batch effect that
    differs by type, as a technology or a stimulation makes): the cells labelled known types
    get p <= alpha far more often than 2 alpha, and the run says that the test's premise fails
    in the query's batch, in the record and in its notes.
    """
    a = orca_sc.datasets.simulate(2400, 400, 6, n_batches=2, type_batch_strength=1.5,
                                  batch_weights=[0.5, 0.5], seed=0)  # fmt: skip
    b = a.obs["batch"].astype(str).to_numpy()
    ref, query = a[b == "batch_0"].copy(), a[b == "batch_1"].copy()
    out = orca_sc.tl.annotate(query, ref, labels_key="cell_type", copy=True, seed=0, **FAST)
    test = out.uns["orca"]["novelty_test"]
    premise = test["premise"]
    assert premise["holds"] == ["fails"] and premise["share_p_below_alpha"][0] > 2 * 0.05
    assert premise["n_known"][0] == int(out.obs["orca_novel"].isna().sum())
    assert any("premise fails" in n for n in test["notes"])
    assert all(c == "known cells of its batch" for c in test["clusters"]["compared_with"])
    # the most shifted known type is called a novel cluster here; the report says above the
    # novel clusters that the test's premise fails
    assert test["clusters"]["cluster"]
    html = orca_sc.tl.report(out, tmp_path / "run.html").read_text()
    assert "the test's premise fails</b>" in html


def test_novel_cells_get_small_pvalues_and_supported_clusters(small_sim):
    # three warm-up epochs: one (FAST) leaves an embedding too raw to score distances in
    opts = {**FAST, "epochs": 10, "warmup_epochs": 3}
    out = orca_sc.tl.annotate(small_sim, labels_key="lab", copy=True, seed=0, **opts)
    p = out.obs["orca_novelty_pvalue"].to_numpy()
    labelled = out.obs["lab"].notna().to_numpy()
    assert np.isnan(p[labelled]).all() and np.isfinite(p[~labelled]).all()
    truth = out.obs["cell_type"].astype(str).to_numpy()
    novel = np.isin(truth, ["type_3", "type_4"]) & ~labelled
    known = ~novel & ~labelled
    assert np.median(p[novel]) < 0.05 and np.median(p[known]) > 0.3
    q = out.obs["orca_novelty_qvalue"].to_numpy()
    assert np.mean(q[novel] <= 0.05) > 0.3 and np.mean(q[known] <= 0.05) < 0.05
    test = out.uns["orca"]["novelty_test"]
    assert test["n_called"] == int((q[~labelled] <= 0.05).sum()) > 0
    assert not any("on its own" in line for line in test["note_lines"])
    table = out.uns["orca"]["novelty_test"]["clusters"]
    sizes = dict(zip(table["cluster"], table["n_cells"], strict=True))
    big = [c for c, s in sizes.items() if s >= 30]
    assert big and all(
        v == "significant"
        for c, v in zip(table["cluster"], table["supported"], strict=True)
        if c in big
    )


def test_no_pvalues_when_switched_off(small_sim):
    out = orca_sc.tl.annotate(
        small_sim, labels_key="lab", copy=True, seed=0, novelty_folds=0, **FAST
    )
    assert "orca_novelty_pvalue" not in out.obs and "novelty_test" not in out.uns["orca"]
    with pytest.raises(orca_sc.OrcaInputError, match="novelty_folds"):
        orca_sc.tl.annotate(small_sim, labels_key="lab", novelty_folds=1, **FAST)
    with pytest.raises(orca_sc.OrcaInputError, match="novelty_alpha"):
        orca_sc.tl.annotate(small_sim, labels_key="lab", novelty_alpha=1.5, **FAST)
