import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from conftest import rare_in_reference

import orca_sc
from orca_sc import OrcaConfig, OrcaInputError
from orca_sc._ablation import Ablation, DiscoveryRules
from orca_sc._align import _SUM_CHUNK, centroid_shift, class_centroids, group_domain_means
from orca_sc._data import prepare
from orca_sc._read import detect_scale, log_normalize


def _adata(X, genes=None, labels=None):
    n, g = X.shape
    a = ad.AnnData(X=sp.csr_matrix(X, dtype=np.float32))
    a.var_names = genes or [f"g{i}" for i in range(g)]
    a.obs_names = [f"c{i}" for i in range(n)]
    if labels is not None:
        a.obs["cell_type"] = labels
    return a


def test_detect_scale_counts_vs_log():
    counts = sp.csr_matrix(np.array([[0, 3, 1], [2, 0, 5]], dtype=np.float32))
    assert detect_scale(counts) == "counts"
    assert detect_scale(log_normalize(counts, 1e4)) == "log-normalized"


def test_log_normalize_hand_computed_and_sparse():
    X = sp.csr_matrix(np.array([[1, 3, 0], [0, 0, 2]], dtype=np.float32))
    Y = log_normalize(X, 1e4)
    assert sp.issparse(Y) and Y.nnz == X.nnz
    np.testing.assert_allclose(Y.toarray(), np.log1p([[2500, 7500, 0], [0, 0, 10000]]), rtol=1e-6)
    assert X[0, 1] == 3  # input untouched


@pytest.mark.parametrize(
    ("value", "match"),
    [(-1.0, "negative values"), (np.nan, "NaN or infinite"), (np.inf, "NaN or infinite")],
)
def test_bad_values_raise(value, match):
    X = np.ones((20, 150), dtype=np.float32)
    X[3, 4] = value
    a = _adata(X, labels=["a"] * 5 + ["b"] * 5 + [None] * 10)
    with pytest.raises(OrcaInputError, match=match):
        prepare(a, None, "cell_type", OrcaConfig(n_genes=None))


def test_unlogged_normalised_values_raise():
    X = np.full((5, 150), 123.4, dtype=np.float32)
    with pytest.raises(OrcaInputError, match="not log-transformed"):
        detect_scale(sp.csr_matrix(X))


def test_gene_alignment_intersects_and_reorders():
    rng = np.random.default_rng(0)
    genes = [f"g{i}" for i in range(200)]
    ref = _adata(rng.poisson(1, (30, 200)), genes, ["a"] * 15 + ["b"] * 15)
    q_genes = genes[::-1][:150] + [f"x{i}" for i in range(20)]  # reversed subset + extras
    q = _adata(rng.poisson(1, (10, 170)), q_genes)
    d = prepare(q, ref, "cell_type", OrcaConfig(n_genes=None))
    assert d.info["n_shared_genes"] == 150
    assert d.genes == [g for g in genes if g in set(q_genes)]  # reference order
    # the query's values follow their gene names, not their positions
    col_q = q.var_names.get_loc("g120")
    col_d = d.genes.index("g120")
    expected = np.log1p(1e4 * q.X[:, col_q].toarray().ravel() / q.X.sum(axis=1).A1)
    np.testing.assert_allclose(d.X[30:, col_d].toarray().ravel(), expected, rtol=1e-5)
    assert d.input_scale == {"query": "counts", "reference": "counts"}
    assert (d.labels[:30] >= 0).all() and (d.labels[30:] == -1).all()


def test_too_few_shared_genes_names_examples():
    ref = _adata(np.ones((10, 120)), [f"r{i}" for i in range(120)], ["a"] * 5 + ["b"] * 5)
    q = _adata(np.ones((5, 120)), [f"q{i}" for i in range(120)])
    with pytest.raises(OrcaInputError, match=r"Only 0 genes are shared.*'r0'.*'q0'"):
        prepare(q, ref, "cell_type", OrcaConfig(n_genes=None))


def test_low_gene_overlap_warns():
    genes = [f"g{i}" for i in range(400)]
    ref = _adata(np.ones((10, 400)), genes, ["a"] * 5 + ["b"] * 5)
    q = _adata(np.ones((5, 150)), genes[:150])
    with pytest.warns(UserWarning, match="150 of the reference's 400 genes"):
        prepare(q, ref, "cell_type", OrcaConfig(n_genes=None))


def test_duplicate_genes_raise():
    a = _adata(
        np.ones((4, 150)), ["g0"] * 2 + [f"g{i}" for i in range(2, 150)], ["a", "b", None, None]
    )
    with pytest.raises(OrcaInputError, match="duplicate gene names.*var_names_make_unique"):
        prepare(a, None, "cell_type", OrcaConfig(n_genes=None))


def test_label_errors():
    X = np.ones((6, 150))
    with pytest.raises(OrcaInputError, match="labels_key 'nope'.*columns: 'cell_type'"):
        prepare(_adata(X, labels=["a"] * 6), None, "nope", OrcaConfig(n_genes=None))
    with pytest.raises(OrcaInputError, match="at least 2 known cell types"):
        prepare(
            _adata(X, labels=["a"] * 3 + [None] * 3), None, "cell_type", OrcaConfig(n_genes=None)
        )
    with pytest.raises(OrcaInputError, match="no unlabelled cells"):
        prepare(_adata(X, labels=["a", "b"] * 3), None, "cell_type", OrcaConfig(n_genes=None))
    with pytest.raises(OrcaInputError, match="no cells"):
        prepare(_adata(np.ones((0, 150)), labels=[]), None, "cell_type", OrcaConfig(n_genes=None))


def test_unlabeled_category_and_single_cell_class_warning():
    labels = ["a", "a", "b", "Unknown", "unk", np.nan]
    a = _adata(np.ones((6, 150)), labels=labels)
    with pytest.warns(UserWarning, match="single cell"):
        d = prepare(
            a, None, "cell_type", OrcaConfig(n_genes=None, unlabeled_category=("Unknown", "unk"))
        )
    assert d.classes == ["a", "b"]
    assert d.labels.tolist() == [0, 0, 1, -1, -1, -1]


def test_layer_missing_and_used():
    a = _adata(np.ones((6, 150)), labels=["a", "b", "a", "b", None, None])
    with pytest.raises(OrcaInputError, match="Layer 'counts' not found"):
        prepare(a, None, "cell_type", OrcaConfig(n_genes=None, layer="counts"))
    a.layers["counts"] = a.X * 2
    d = prepare(a, None, "cell_type", OrcaConfig(n_genes=None, layer="counts"))
    assert d.input_scale["AnnData"] == "counts"


def test_hvg_selection_is_batch_aware_and_sparse():
    a = orca_sc.datasets.simulate(400, 500, 4, n_batches=2, seed=1)
    a.obs["lab"] = a.obs.cell_type.astype(object).where(a.obs.batch == "batch_0", None)
    d = prepare(a, None, "lab", OrcaConfig(n_genes=100, batch_key="batch"))
    assert d.X.shape == (400, 100) and sp.isspmatrix_csr(d.X) and d.X.dtype == np.float32
    assert d.domain_names == ["batch_0", "batch_1"]


def test_centroid_shift_recovers_offset_despite_novel_cells():
    rng = np.random.default_rng(0)
    g = 50
    centroids = rng.gamma(2.0, 1.0, (3, g)).astype(np.float32)
    true_shift = rng.normal(0, 0.3, g)
    known = np.repeat(centroids, 100, axis=0) - true_shift + rng.normal(0, 0.2, (300, g))
    novel = rng.gamma(2.0, 1.0, (1, g)) * 3 + rng.normal(0, 0.2, (150, g))  # type absent from ref
    Xq = sp.csr_matrix(np.vstack([known, novel]).astype(np.float32))
    est = centroid_shift(Xq, centroids)
    assert np.corrcoef(est, true_shift)[0, 1] > 0.9
    assert np.abs(est - true_shift).mean() < 0.1


def test_type_alignment_moves_each_matched_type_onto_its_centroid_and_leaves_novel_cells():
    """The per-type alignment (a study's setting): the query cells of each known type that
    match it with confidence, shifted by the type's own vector, land on its reference centroid;
    the cells of a type the reference lacks keep the batch's shift.
    """
    from orca_sc._align import compute_transform

    rng = np.random.default_rng(1)
    g, n = 60, 120
    centroids = rng.gamma(2.0, 1.0, (3, g))
    ref = np.repeat(centroids, n, axis=0) + rng.normal(0, 0.2, (3 * n, g))
    shifts = rng.normal(0, 0.1, (3, g))  # each type shifted its own way in the query
    known = np.repeat(centroids - shifts, n, axis=0) + rng.normal(0, 0.2, (3 * n, g))
    novel = rng.gamma(2.0, 1.0, (1, g)) * 3 + rng.normal(0, 0.2, (n, g))
    X = sp.csr_matrix(np.maximum(np.vstack([ref, known, novel]), 0).astype(np.float32))
    labels = np.r_[np.repeat(np.arange(3), n), -np.ones(4 * n, dtype=int)]
    domain = np.r_[np.zeros(3 * n, dtype=int), np.ones(4 * n, dtype=int)]
    scale, offset, info, group = compute_transform("centroid", X, labels, domain, 2, 3, "matched")
    assert group is not None and scale.shape[0] == offset.shape[0] == 2 + 3
    q_known, q_novel = np.arange(3 * n, 6 * n), np.arange(6 * n, 7 * n)
    assert (group[: 3 * n] == 0).all() and (group[q_novel] == 1).all()  # the batch's shift
    matched = info["per_type"]["matched"][1]
    for k in range(3):
        cells = q_known[k * n : (k + 1) * n]
        own = cells[group[cells] != 1]
        codes = np.unique(group[own])
        assert codes.size == 1 and codes[0] >= 2 and own.size == matched[k] >= n // 2
        moved = (X[own].toarray() * scale[codes[0]] + offset[codes[0]]).mean(axis=0)
        np.testing.assert_allclose(moved, X[labels == k].toarray().mean(axis=0), atol=1e-4)
    # "nearest": no type split between two shifts, but the novel cells move with their
    # nearest type; "cluster": each query cluster moves whole, and the novel one stays
    near = compute_transform("centroid", X, labels, domain, 2, 3, "nearest")[3]
    from functools import partial

    from orca_sc._context import _batch_clusters

    clusters = partial(_batch_clusters, X, domain)  # Leiden on the batch's PCA, as a run does
    clus = compute_transform("centroid", X, labels, domain, 2, 3, "cluster", clusters)[3]
    for k in range(3):
        cells = q_known[k * n : (k + 1) * n]
        assert np.unique(near[cells]).size == 1 and np.unique(clus[cells]).size == 1
        assert clus[cells][0] == group[cells][group[cells] != 1][0]  # the same type's row
    assert (near[q_novel] >= 2).all() and (clus[q_novel] == 1).all()
    # off (the default): the batches' rows alone
    assert compute_transform("centroid", X, labels, domain, 2, 3)[3] is None


def test_class_centroids():
    X = sp.csr_matrix(np.array([[1.0, 0], [3.0, 2], [0, 4.0]]))
    c = class_centroids(X, np.array([0, 0, 1]), 2)
    np.testing.assert_allclose(c, [[2.0, 1.0], [0.0, 4.0]])


def test_group_domain_means_match_dense_means_and_the_indicator_product_exactly():
    """Per-(group, batch) means over several chunks of cells, cells outside every group left
    out: the dense means, and bit for bit the float64 sums of a sparse indicator product taken
    chunk by chunk (what every alignment, naming and calibration number was computed from).
    """
    rng = np.random.default_rng(3)
    n, g, n_groups, n_dom = 2 * _SUM_CHUNK + 517, 40, 4, 3
    X = sp.random(n, g, density=0.3, format="csr", random_state=4, dtype=np.float32)
    X.data = np.log1p(X.data * 50).astype(np.float32)
    groups = rng.integers(-1, n_groups, n)
    groups[groups == 2] = -1  # an empty group
    domain = rng.integers(0, n_dom, n)
    means, counts = group_domain_means(X, groups, n_groups, domain, n_dom)
    dense = X.toarray().astype(np.float64)
    for k in range(n_groups):
        for d in range(n_dom):
            rows = (groups == k) & (domain == d)
            assert counts[k, d] == rows.sum()
            expected = dense[rows].mean(axis=0) if rows.any() else np.zeros(g)
            np.testing.assert_allclose(means[k, d], expected, rtol=1e-10, atol=1e-12)
    keep = np.flatnonzero(groups >= 0)
    ind = sp.csr_matrix(
        (np.ones(keep.size), (groups[keep] * n_dom + domain[keep], keep)),
        shape=(n_groups * n_dom, n),
    ).tocsc()
    sums = np.zeros((n_groups * n_dom, g))
    for start in range(0, n, _SUM_CHUNK):
        sums += (ind[:, start : start + _SUM_CHUNK] @ X[start : start + _SUM_CHUNK]).toarray()
    old = sums / np.maximum(counts.reshape(-1), 1)[:, None]
    assert np.array_equal(means.reshape(n_groups * n_dom, g), old)


def test_config_validation():
    with pytest.raises(ValueError, match="n_novel"):
        OrcaConfig(n_novel=-1)
    with pytest.raises(ValueError, match="n_novel"):
        OrcaConfig(n_novel="many")
    with pytest.raises(TypeError, match="margin"):  # the method's setting, not an option
        OrcaConfig(margin="big")
    with pytest.raises(ValueError, match="batch_size"):
        OrcaConfig(batch_size=1)
    cfg = OrcaConfig(unlabeled_category="NA", hidden_dims=[64, 32])
    assert cfg.unlabeled_category == ("NA",) and cfg.hidden_dims == (64, 32)
    assert OrcaConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="Unknown configuration keys"):
        OrcaConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match='"per_type" or "none"'):
        orca_sc.DiscoveryConfig(cross_fit_threshold="per type")
    with pytest.raises(ValueError, match='"per_type" or "none"'):  # the retired cap
        orca_sc.DiscoveryConfig(cross_fit_threshold="cap")
    # the per-type threshold needs the folds, but without them it falls back to the in-sample
    # rule (novelty_folds=0 is how a user skips the warm-ups)
    assert orca_sc.DiscoveryConfig(novelty_folds=0).cross_fit_threshold == "per_type"
    # `--set cross_fit_threshold=none` and `--set integration=none` read the word as None
    none = orca_sc.DiscoveryConfig(cross_fit_threshold=None, integration=None)
    assert (none.cross_fit_threshold, none.integration) == ("none", "none")
    # models saved by 0.2.0 still load: False as the in-sample rule, True (the retired cap) as
    # today's default
    old = {**OrcaConfig().to_dict(), "discovery": {"cross_fit_threshold": False}}
    assert OrcaConfig.from_dict(old).discovery.cross_fit_threshold == "none"
    old = {**OrcaConfig().to_dict(), "discovery": {"cross_fit_threshold": "cap"}}
    assert OrcaConfig.from_dict(old).discovery.cross_fit_threshold == "per_type"


def test_simulator_is_seeded_and_realistic():
    a = orca_sc.datasets.simulate(300, 200, 4, n_batches=2, seed=5)
    b = orca_sc.datasets.simulate(300, 200, 4, n_batches=2, seed=5)
    assert (a.X != b.X).nnz == 0
    assert sp.isspmatrix_csr(a.X) and np.all(a.X.data == np.round(a.X.data))
    counts = a.obs.cell_type.value_counts()
    assert counts["type_0"] > 2 * counts["type_3"]  # class imbalance
    lib = np.asarray(a.X.sum(axis=1)).ravel()
    assert lib.std() / lib.mean() > 0.2  # library-size variation
    assert set(a.obs.batch) == {"batch_0", "batch_1"}
    assert isinstance(a.obs.cell_type.dtype, pd.CategoricalDtype)


def test_simulated_subtype_is_its_parent_plus_a_program_of_its_own():
    plain = orca_sc.datasets.simulate(300, 200, 4, markers_per_type=20, seed=5)
    a = orca_sc.datasets.simulate(300, 200, 4, markers_per_type=20, subtype_of={3: 1}, seed=5)
    m, m0 = np.log(a.varm["type_means"]), np.log(plain.varm["type_means"])
    # the other types' programs are those of the same seed without subtypes
    np.testing.assert_allclose(m[:, :3], m0[:, :3], rtol=1e-5)
    diff = m[:, 3] - m[:, 1]  # log-fractions: a constant offset (renormalisation) + own program
    own = np.abs(diff - np.median(diff)) > 1e-4
    assert own.sum() == 10  # half a type's markers, up-regulated only
    assert (diff[own] > np.median(diff)).all()
    assert a.uns["simulation"]["subtype_of"] == {"type_3": "type_1"}
    for bad in ({3: 3}, {4: 1}, {3: 1, 1: 0}):
        with pytest.raises(ValueError, match="subtype_of"):
            orca_sc.datasets.simulate(300, 200, 4, subtype_of=bad, seed=5)


def _log_means(a, batch, t):
    """Mean log1p expression per gene of type ``t`` in ``batch``."""
    rows = ((a.obs.batch == batch) & (a.obs.cell_type == t)).to_numpy()
    return np.log1p(np.asarray(a.X[rows].mean(axis=0)).ravel())


def test_simulated_shift_by_type_and_condition_program():
    kw = {"n_batches": 2, "imbalance": 1.0, "batch_strength": 0.0, "seed": 4}
    plain = orca_sc.datasets.simulate(6000, 400, 3, **kw)
    same = orca_sc.datasets.simulate(6000, 400, 3, type_batch_strength=0.0, **kw)
    assert (plain.X != same.X).nnz == 0  # the options off: the counts of the same seed
    assert not plain.obs["condition"].any()

    # a batch effect that differs by type: one shift for all types (type 0's and type 1's
    # agree) and, with type_batch_strength, a part of each type's own (they agree less)
    def agreement(**extra):
        a = orca_sc.datasets.simulate(6000, 400, 3, **{**kw, "batch_strength": 0.4, **extra})
        t0, t1 = (_log_means(a, "batch_1", t) - _log_means(a, "batch_0", t)
                  for t in ("type_0", "type_1"))  # fmt: skip
        return np.corrcoef(t0, t1)[0, 1]

    shared, mild, severe = (agreement(type_batch_strength=s) for s in (0.0, 0.4, 0.8))
    assert shared > 0.95 and shared - 0.15 > mild > severe + 0.15, (shared, mild, severe)
    # a condition program: up in the responding type of the stimulated batch only
    cond = orca_sc.datasets.simulate(6000, 400, 3, condition={1: [0]}, condition_genes=30, **kw)
    obs = cond.obs
    assert (obs["condition"] == ((obs.batch == "batch_1") & (obs.cell_type == "type_0"))).all()
    up0 = _log_means(cond, "batch_1", "type_0") - _log_means(cond, "batch_0", "type_0")
    up1 = _log_means(cond, "batch_1", "type_1") - _log_means(cond, "batch_0", "type_1")
    top = np.argsort(-up0)[:30]
    assert up0[top].mean() > 0.5 and abs(up1[top].mean()) < 0.15
    assert cond.uns["simulation"]["condition"] == {"batch_1": ["type_0"]}
    for bad in ({"condition": {2: [0]}}, {"condition": {1: [3]}}, {"type_batch_strength": -1},
                {"condition": {1: [0]}, "condition_genes": 0}):  # fmt: skip
        with pytest.raises(ValueError, match="condition|type_batch_strength"):
            orca_sc.datasets.simulate(300, 200, 3, n_batches=2, seed=5, **bad)


def test_batch_key_missing_and_unlabelled_reference():
    genes = [f"g{i}" for i in range(150)]
    ref = _adata(np.ones((6, 150)), genes, ["a", "b"] * 3)
    q = _adata(np.ones((4, 150)), genes)
    with pytest.raises(OrcaInputError, match="batch_key 'donor' is not a column of the reference"):
        prepare(q, ref, "cell_type", OrcaConfig(n_genes=None, batch_key="donor"))
    ref.obs["cell_type"] = [np.nan] * 6
    with pytest.raises(OrcaInputError, match="reference has no labelled cells"):
        prepare(q, ref, "cell_type", OrcaConfig(n_genes=None))


def test_empty_query_is_an_error():
    genes = [f"g{i}" for i in range(150)]
    ref = _adata(np.ones((6, 150)), genes, ["a", "b"] * 3)
    with pytest.raises(OrcaInputError, match="The query has no cells"):
        prepare(_adata(np.ones((0, 150)), genes), ref, "cell_type", OrcaConfig(n_genes=None))


def test_leiden_on_more_than_4096_cells_finds_blobs():
    from orca_sc._discover import leiden

    rng = np.random.default_rng(0)
    centers = rng.normal(0, 10, (4, 10))
    emb = np.vstack([c + rng.normal(0, 1, (1300, 10)) for c in centers])
    codes = leiden(emb, resolution=0.3, seed=0)
    truth = np.repeat(np.arange(4), 1300)
    from sklearn.metrics import adjusted_rand_score

    assert adjusted_rand_score(truth, codes) > 0.95
    np.testing.assert_array_equal(codes, leiden(emb, resolution=0.3, seed=0))  # seeded


def _hidden_fixture(seed=0):
    """Seen classes A (400 cells) and B (300), each half labelled at random, plus a novel type H
    (120 unlabelled cells) that the seen head of A absorbed; one more batch holds unlabelled A
    cells only (a separate query). Features are the 'PCA' directly.
    """
    rng = np.random.default_rng(seed)
    centers = {"A": np.zeros(10), "B": np.r_[12.0, np.zeros(9)], "H": np.r_[0, 6.0, np.zeros(8)]}
    n = {"A": 400, "B": 300, "H": 120}
    emb = np.vstack([centers[t] + rng.normal(0, 1, (n[t], 10)) for t in n])
    truth = np.repeat(list(n), list(n.values()))
    labels = np.where(truth == "A", 0, np.where(truth == "B", 1, -1))
    labels[(labels >= 0) & (rng.random(truth.size) < 0.5)] = -1
    head = np.where(truth == "B", 1, 0)  # H absorbed by A's head
    # a second batch: 150 unlabelled cells of A, shifted (a batch effect), no labels at all
    emb = np.vstack(
        [emb, centers["A"] + np.r_[0, 0, 6.0, np.zeros(7)] + rng.normal(0, 1, (150, 10))]
    )
    truth = np.r_[truth, ["A"] * 150]
    labels = np.r_[labels, [-1] * 150]
    head = np.r_[head, [0] * 150]
    same_batch = np.r_[np.ones(820, bool), np.zeros(150, bool)]
    return emb, truth, labels, head, same_batch


def test_label_deserts_are_the_cells_of_the_type_nobody_labelled():
    """H (never labelled) sits among unlabelled cells only: a desert, even though A's head scores
    it; unlabelled A and B cells sit among labelled ones; the query batch (no labels) is not
    tested, so its A cells are not deserts although none of their neighbours is labelled.
    """
    from orca_sc._discover import label_deserts, labelled_neighbours

    emb, truth, labels, _, same_batch = _hidden_fixture()
    domain = np.where(same_batch, 0, 1)
    lab = labels >= 0
    frac, tested, size = labelled_neighbours(lab, domain, lambda idx: emb[idx])
    assert (size == 15).all()  # no alpha: the n_neighbors of every graph here
    desert = label_deserts(lab, domain, frac, tested)
    assert desert[truth == "H"].mean() > 0.9
    # a binomial test at level 0.01: about 1% of the known unlabelled cells, by chance
    assert desert[(truth != "H") & same_batch & ~lab].mean() < 0.03
    assert not desert[~same_batch].any() and not tested[~same_batch].any()
    assert not desert[lab].any()
    # stricter level: fewer or equal deserts, never more
    strict = label_deserts(lab, domain, frac, tested, alpha=1e-6)
    assert not (strict & ~desert).any() and strict.sum() < desert.sum()


def test_sparse_labels_widen_the_neighbourhood_the_label_tests_read():
    """With a fifth of A and B labelled (10% of the batch), a known cell has no labelled
    neighbour among 15 a fifth of the time: at 15 neighbours no desert can reach the level
    (0.9^15 > 0.01) and half the known cells lack support. With ``alpha`` the tests read as
    many neighbours as a test at that level needs, so H is a desert and the known cells are
    supported; with half of A and B labelled nothing changes.
    """
    from orca_sc._discover import label_deserts, labelled_neighbours, labelled_support
    from orca_sc._discover.labels import neighbourhood_size

    assert neighbourhood_size(0.5, 0.01, 15, 1000) == 15
    assert neighbourhood_size(0.05, 0.01, 15, 1000) == 90  # 0.95^90 < 0.01 <= 0.95^89
    assert neighbourhood_size(0.05, 0.01, 15, 40) == 39
    assert neighbourhood_size(1.0, 0.01, 15, 99) == 15
    assert neighbourhood_size(0.05, 0.0, 15, 1000) == 15  # desert_alpha 0: no test to power
    emb, truth, labels, _, same_batch = _hidden_fixture()
    domain = np.where(same_batch, 0, 1)
    rng = np.random.default_rng(1)
    sparse = (labels >= 0) & (rng.random(labels.size) < 0.2)
    known = ~sparse & np.isin(truth, ["A", "B"]) & same_batch
    fixed = labelled_neighbours(sparse, domain, lambda idx: emb[idx])
    wide = labelled_neighbours(sparse, domain, lambda idx: emb[idx], alpha=0.01)
    assert (fixed[2] == 15).all() and (wide[2][same_batch] >= 40).all()
    assert (wide[2][~same_batch] == 15).all()  # the batch without labels is not tested
    res = {}
    for name, (frac, tested, size) in (("fixed", fixed), ("wide", wide)):
        res[name] = (label_deserts(sparse, domain, frac, tested, n_neighbors=size),
                     labelled_support(sparse, domain, frac, tested, n_neighbors=size))  # fmt: skip
    desert, sup = res["fixed"]
    assert not desert.any() and sup[known].mean() < 0.6
    desert, sup = res["wide"]
    assert desert[truth == "H"].mean() > 0.9 and desert[known].mean() < 0.03
    assert sup[known].mean() > 0.9 and sup[truth == "H"].mean() < 0.05
    half = labelled_neighbours(labels >= 0, domain, lambda idx: emb[idx], alpha=0.01)
    np.testing.assert_array_equal(half[0], fixed_half := labelled_neighbours(
        labels >= 0, domain, lambda idx: emb[idx])[0])  # fmt: skip
    assert (half[2] == 15).all() and fixed_half.size == labels.size


def test_calibrate_resolution_follows_the_granularity_of_the_labels():
    """Four separate groups, each a continuum cut into three sub-types along its length: labels
    naming the groups calibrate a coarser resolution than labels naming the sub-types; one
    class cannot be calibrated.
    """
    from orca_sc._discover import calibrate_resolution

    defaults = DiscoveryRules()

    rng = np.random.default_rng(0)
    centers = rng.normal(0, 30, (4, 10))
    dirs = rng.normal(size=(4, 10))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    t = rng.uniform(-6, 6, (4, 300))  # position along each group
    emb = np.vstack(
        [centers[g] + t[g, :, None] * dirs[g] + rng.normal(0, 1, (300, 10)) for g in range(4)]
    )
    fine = np.concatenate([3 * g + np.digitize(t[g], [-2, 2]) for g in range(4)])
    coarse = fine // 3
    r_fine, s_fine = calibrate_resolution(fine, lambda idx: emb[idx])
    r_coarse, s_coarse = calibrate_resolution(coarse, lambda idx: emb[idx])
    assert r_coarse < r_fine
    assert (
        len(s_fine) == len(defaults.resolution_grid) and max(s_coarse) > 0.95 and max(s_fine) > 0.5
    )
    # unlabelled cells (-1) are ignored; a single labelled class falls back
    one = np.where(fine == 0, 0, -1)
    assert calibrate_resolution(one, lambda idx: emb[idx]) == (defaults.fallback_resolution, [])
    part = np.where(rng.random(fine.size) < 0.5, coarse, -1)
    assert calibrate_resolution(part, lambda idx: emb[idx])[0] < r_fine
    # DiscoveryConfig.resolution: a number is used as given, "auto" is calibrated, or falls back
    # when there is nothing to calibrate against
    from orca_sc._discover import resolve_resolution

    two = DiscoveryRules(resolution=2)
    assert resolve_resolution(fine, lambda idx: emb[idx], cfg=two) == (2.0, [])
    assert resolve_resolution(fine, lambda idx: emb[idx]) == (r_fine, s_fine)
    auto_off = resolve_resolution(fine, lambda idx: emb[idx], calibrate=False)
    assert auto_off == (defaults.fallback_resolution, [])


def test_labelled_support_keeps_poorly_scored_known_cells_out_of_novel_candidates():
    from orca_sc._discover import labelled_neighbours, labelled_support

    emb, truth, labels, _, same_batch = _hidden_fixture()
    domain = np.where(same_batch, 0, 1)
    frac, tested, _ = labelled_neighbours(labels >= 0, domain, lambda idx: emb[idx])
    assert tested.tolist() == same_batch.tolist()
    # around labelled cells about half the neighbours are labelled (A, B labelled at random)
    assert 0.4 < frac[labels >= 0].mean() < 0.6
    sup = labelled_support(labels >= 0, domain, frac, tested)
    unl = labels < 0
    known = unl & np.isin(truth, ["A", "B"]) & same_batch
    assert sup[known].mean() > 0.9  # unlabelled A/B cells sit among labelled ones
    assert sup[truth == "H"].mean() < 0.05  # nobody labelled H: no support
    assert not sup[~same_batch].any()  # a batch without labels is never tested
    assert not sup[labels >= 0].any()


def test_cluster_cores_keeps_coherent_clusters_and_drops_mixed_ones():
    from orca_sc._discover import cluster_cores

    rng = np.random.default_rng(0)
    # four well-separated groups of 100 cells in 5-d space
    centers = 10.0 * np.eye(5)[:4]
    feats = np.vstack([c + rng.normal(0, 1, (100, 5)) for c in centers])
    group = np.repeat(np.arange(4), 100)
    assign = np.full(400, -1)
    assign[group == 0] = 0  # a whole group: coherent
    assign[group == 1] = 1  # another whole group, minus a few stragglers
    assign[np.flatnonzero(group == 1)[:5]] = -1
    # a "cluster" of scattered cells: 20 from each of groups 2 and 3, among non-candidates
    mixed = np.r_[np.flatnonzero(group == 2)[:20], np.flatnonzero(group == 3)[:20]]
    assign[mixed] = 2
    core = cluster_cores(assign, feats)
    assert core[assign == 0].all() and core[assign == 1].mean() > 0.95
    assert not core[assign == 2].any()  # its cells' neighbours are mostly not in it
    assert not core[assign == -1].any()
    # with a lax coherence bar the mixed cluster's few agreeing cells would come back
    lax = cluster_cores(assign, feats, min_core=0.0)
    assert core.sum() < lax.sum() or not lax[assign == 2].any()
    assert cluster_cores(np.full(400, -1), feats).sum() == 0


def test_significant_cells_bound_the_false_discovery_rate_among_query_cells():
    """Benjamini-Hochberg over the query cells: among the cells returned, the share of cells
    with uniform (null) p-values stays near ``alpha`` or below; a cell without a p-value counts
    as p = 1 and a reference cell is never returned.
    """
    from orca_sc._discover.heads import significant_cells

    rng = np.random.default_rng(0)
    shares = []
    for _ in range(200):
        n_null, n_novel = 900, 100
        p = np.r_[rng.uniform(size=n_null), rng.uniform(0, 0.002, n_novel)]
        query = np.ones(p.size, dtype=bool)
        sig = significant_cells(p, query, 0.05)
        assert sig[n_null:].mean() > 0.9  # the novel cells' tiny p-values are found
        shares.append(sig[:n_null].sum() / max(sig.sum(), 1))
    assert np.mean(shares) <= 0.05  # BH: FDR <= alpha * n_null / n (p <= alpha alone: ~0.3)
    p = np.array([1e-4, np.nan, 1e-4, 0.9])
    sig = significant_cells(p, np.array([True, True, False, True]), 0.05)
    assert sig.tolist() == [True, False, False, False]
    assert not significant_cells(p, np.zeros(4, dtype=bool), 0.05).any()


def test_small_query_keeps_its_novel_type_with_significant_cells_anchored():
    """A 150-cell query (the development suite's ``sim_query150`` at seed 0): its candidate
    clusters are too small to have core cells, so without the significant cells as anchors
    training hands a third of the novel-type cells to known heads (novel->novel 0.648 in the
    suite); with them every novel-type cell stays novel and no known cell is called novel.
    """
    from dataclasses import replace

    from orca_sc.benchmark import SimSetting, make_sim_task
    from orca_sc.benchmark._methods import annotate_task

    task = make_sim_task(replace(SimSetting("base"), name="query150", n_query=150), 0)
    a, q = annotate_task(task, 0)
    est = a.uns["orca"]["estimate"]
    assert est["n_anchored_significant"] > 0 and est["n_anchored"] >= est["n_anchored_significant"]
    novel = np.isin(a.obs["truth"].to_numpy()[q], task.novel)
    called = a.obs["orca_novel"].notna().to_numpy()[q]
    assert called[novel].mean() >= 0.9 and called[~novel].mean() <= 0.05


def test_small_query_keeps_its_known_cells_with_pairs_in_the_expression_pca():
    """One 180-cell query of two known types and one novel type (the development suite's
    ``sim_queries1_q180`` at seed 0). Discovery finds the novel type exactly; with partners
    from the net's embedding as well (``pair_space="both"``) training then hands a sixth of the
    known-type cells to its head. Pairing the query's cells in the PCA of the aligned
    expression alone (the partner's nearest cells read there too) keeps them known.
    """
    from orca_sc.benchmark import dev_suite
    from orca_sc.benchmark._methods import annotate_task

    task = dev_suite(None, only=["sim_queries1_q180"])[0].make(0)
    for space, known_ok in (("query_pca", True), ("both", False)):
        a, q = annotate_task(task, 0, ablation=Ablation(pair_space=space))
        novel = np.isin(a.obs["truth"].to_numpy()[q], task.novel)
        called = a.obs["orca_novel"].notna().to_numpy()[q]
        assert called[novel].mean() >= 0.9
        assert (called[~novel].mean() <= 0.05) == known_ok, (space, called[~novel].mean())


def test_cluster_cores_link_pieces_of_one_population_and_no_mixed_cluster():
    """A group voted in three query batches is three candidates whose cells' neighbours lie in
    all three: alone no piece is coherent; linked, every piece is. A cluster of scattered
    cells beside it stays unanchored either way.
    """
    from orca_sc._discover import cluster_cores

    rng = np.random.default_rng(1)
    centers = 10.0 * np.eye(5)[:3]
    feats = np.vstack([c + rng.normal(0, 1, (150, 5)) for c in centers])
    group = np.repeat(np.arange(3), 150)
    assign = np.full(450, -1)
    assign[group == 0] = rng.integers(0, 3, 150)  # one population, three batches' pieces
    mixed = np.r_[np.flatnonzero(group == 1)[:15], np.flatnonzero(group == 2)[:15]]
    assign[mixed] = 3
    alone = cluster_cores(assign, feats, link=False)
    assert not alone[group == 0].any()  # about a third of the neighbours in the own piece
    linked = cluster_cores(assign, feats)
    assert linked[group == 0].mean() > 0.95
    assert not linked[assign == 3].any() and not linked[assign == -1].any()
    # two separate coherent candidates are not linked: the same cores with and without
    whole = np.where(group < 2, group, -1)
    assert (cluster_cores(whole, feats) == cluster_cores(whole, feats, link=False)).all()
    # a population one of whose pieces is coherent alone: that piece is anchored, the other
    # piece (its cells' neighbours mostly in the first) is left to training, as without links
    big = np.where(group == 0, 0, -1)
    big[np.flatnonzero(group == 0)[:30]] = 1
    with_link = cluster_cores(big, feats)
    assert with_link[big == 0].mean() > 0.95 and not with_link[big == 1].any()
    assert (with_link == cluster_cores(big, feats, link=False)).all()


def test_match_known_types_finds_a_rare_reference_type_not_a_novel_one():
    from orca_sc._discover import match_known_types

    ref, query = rare_in_reference()
    X = sp.vstack([ref.X, query.X]).tocsr()
    classes = sorted(ref.obs["cell_type"].unique())
    labels = np.r_[[classes.index(c) for c in ref.obs["cell_type"]], [-1] * query.n_obs]
    domain = np.r_[np.zeros(ref.n_obs), np.ones(query.n_obs)].astype(np.int64)
    tq = query.obs["cell_type"].to_numpy()
    clusters = np.r_[
        [-1] * ref.n_obs,
        np.select([tq == "type_3", tq == "type_5", tq == "type_0"], [0, 1, 2], -1),
    ]
    merged = match_known_types(X, labels, domain, clusters, 3, len(classes), 0.7)
    got = {j: classes[k] for j, k, _ in merged}
    assert got == {0: "type_3", 2: "type_0"}  # the novel type_5 stays novel
    assert all(r >= 0.7 for *_, r in merged)
    # one batch: labels there already say which cells are type_3, so nothing is merged
    one = match_known_types(X, labels, np.zeros_like(domain), clusters, 3, len(classes), 0.7)
    assert one == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("merge_threshold", 0.0),
        ("merge_threshold", 1.5),
        ("merge_threshold", True),
        ("n_genes", 1),
        ("hidden_dims", (64,)),
        ("dropout", 1.0),
        ("epochs", 0),
        ("warmup_epochs", -2),
        ("lr", 0.0),
        ("resolution", -1.0),
        ("resolution", "fine"),
        ("alignment", "magic"),
        ("device", "tpu"),
        ("seed", 1.5),
    ],
)
def test_every_config_field_is_validated(field, value):
    """Discovery fields are validated by DiscoveryConfig, also when given to OrcaConfig.replace
    (as ``annotate`` does with keywords).
    """
    with pytest.raises(ValueError, match=f"Invalid {field}="):
        OrcaConfig().replace(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("anchor_epochs", -1),
        ("anchor_weight", -0.5),
        ("eta2", -0.1),
        ("prior", "flat"),
        ("pair_space", "raw"),
        ("pair_pcs", 1),
        ("mutual_pairs", -1),
        ("epoch_min_steps", -1),
        ("ood_quantile", 1.5),
        ("resolution_grid", ()),
        ("resolution_grid", (0.5, -1)),
        ("fallback_resolution", 0),
        ("calibration_cells", 0),
        ("n_pcs", 1),
        ("max_cells", 0),
        ("min_novel_cells", 0),
        ("min_novel_cells", 1.5),
        ("support_fraction", 2.0),
        ("support_min", -1),
        ("desert_alpha", float("nan")),
        ("segregated_support", -1),
        ("query_resolution", 0),
        ("query_resolution", "labels"),
        ("query_resolution_grid", (1.0, 0)),
        ("query_mapping", "scarches"),
        ("query_min_fraction", 1.1),
        ("query_min_enrichment", -2),
        ("core_min_agree", 1.2),
        ("core_min_fraction", -0.2),
        ("anchor_supported", 1),
        ("no_warmup_rel_threshold", 3),
        ("query_vote_cells", 10),
        ("query_vote_cells", 2500.0),
    ],
)
def test_every_method_setting_is_validated(field, value):
    """The benchmark's settings (the paper's ablations, the rules' constants) are validated as
    the options are.
    """
    with pytest.raises(ValueError, match=f"Invalid {field}="):
        Ablation.of(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_neighbors", 1),
        ("pca_input", "counts"),
        ("discovery_cells", 500),
        ("discovery_cells", 2e4),
        ("calibration_fraction", 1.5),
    ],
)
def test_every_discovery_field_is_validated(field, value):
    with pytest.raises(ValueError, match=f"Invalid {field}="):
        orca_sc.DiscoveryConfig(**{field: value})


def test_discovery_config_round_trips_and_refuses_unknown_keys():
    cfg = OrcaConfig(n_genes=50).replace(merge_threshold=None, resolution=0.3, n_neighbors=20)
    assert OrcaConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.discovery.resolution == 0.3 and cfg.discovery.merge_threshold is None
    # a discovery option at the top level is not an OrcaConfig field
    with pytest.raises(ValueError, match=r"Unknown configuration keys \['resolution'\]"):
        OrcaConfig.from_dict({**cfg.to_dict(), "resolution": 0.3})
    with pytest.raises(TypeError, match="hidden_novel"):
        orca_sc.DiscoveryConfig(hidden_novel=True)
    # a model file of 0.2.0 has the options of the removed minimum cluster size: they are dropped
    old = cfg.to_dict()
    old["discovery"] |= {"min_cluster_cells": 5, "min_cluster_fraction": 0.005}
    assert OrcaConfig.from_dict(old) == cfg
    with pytest.raises(TypeError, match="min_cluster_cells"):
        orca_sc.DiscoveryConfig(min_cluster_cells=5)
    # and one saved before the out-of-distribution vote and the probe warm-up were removed
    old["discovery"] |= {"ood_ensemble": 0, "calibration_probe": False}
    assert OrcaConfig.from_dict(old) == cfg
    with pytest.raises(TypeError, match="ood_ensemble"):
        orca_sc.DiscoveryConfig(ood_ensemble=2)
    # and one saved when the method's settings and the retired alternatives were options
    old |= {"margin": "adaptive", "min_steps": 300, "stop_every_epoch": False, "weight_decay": 0}
    old["discovery"] |= {"query_vote": "contrast", "ood_quantile": 0.01, "share_vote_test": True}
    assert OrcaConfig.from_dict(old) == cfg
    with pytest.raises(ValueError, match="Unknown configuration keys"):
        orca_sc.DiscoveryConfig.from_dict({"bogus": 1})


def test_loading_a_missing_model_file(tmp_path):
    with pytest.raises(OrcaInputError, match="does not exist"):
        orca_sc.OrcaModel.load(tmp_path / "nope.pt")


def test_query_ood_clusters_votes_per_cluster():
    from orca_sc._discover import query_ood_clusters

    rng = np.random.default_rng(0)
    # one query batch of four well-separated groups; out-of-distribution calls are noisy:
    # N (novel) 70% flagged, K1 and K2 (known, shifted) 5%, M (novel, weakly scored) 40% -
    # below a majority, but about 3x the batch's overall rate (14%)
    n = {"N": 60, "K1": 300, "K2": 300, "M": 80}
    rate = {"N": 0.7, "K1": 0.05, "K2": 0.05, "M": 0.4}
    centers = {t: 10.0 * np.eye(4)[i] for i, t in enumerate(n)}
    emb = np.vstack([centers[t] + rng.normal(0, 1, (n[t], 4)) for t in n])
    truth = np.repeat(list(n), list(n.values()))
    ood = rng.random(truth.size) < np.array([rate[t] for t in truth])
    cells = np.arange(truth.size)
    domain = np.zeros(truth.size, dtype=np.int64)
    groups = query_ood_clusters(ood, cells, domain, lambda idx: emb[idx], resolution=0.2)
    found = sorted(pd.Series(truth[g]).mode()[0] for g in groups)
    assert found == ["M", "N"]
    for g in groups:
        t = pd.Series(truth[g]).mode()[0]
        assert (truth[g] == t).mean() > 0.95 and g.size >= 0.95 * n[t]
    # the enrichment rule: with it off, M (40% flagged) is not a candidate
    only_majority = query_ood_clusters(
        ood, cells, domain, lambda idx: emb[idx], resolution=0.2, min_enrichment=np.inf
    )
    assert [pd.Series(truth[g]).mode()[0] for g in only_majority] == ["N"]


def test_query_vote_on_a_sample_reads_as_many_cells_at_any_size():
    """A batch of ten times the cells, voted on a sample of the original batch's size: the
    candidates are the same types, each holding all of its cells (those out of the sample take
    their nearest sample cells' cluster), the votes read the sample's cells only, and the same
    seed gives the same result. A batch no larger than the sample is clustered as before.
    """
    from orca_sc._discover import query_ood_clusters
    from orca_sc._discover.graph import leiden
    from orca_sc._discover.query import sampled_clusters

    rng = np.random.default_rng(3)
    n = {"N": 600, "K1": 3000, "K2": 3000, "M": 800}
    rate = {"N": 0.7, "K1": 0.05, "K2": 0.05, "M": 0.4}
    centers = {t: 10.0 * np.eye(4)[i] for i, t in enumerate(n)}
    emb = np.vstack([centers[t] + rng.normal(0, 1, (n[t], 4)) for t in n])
    truth = np.repeat(list(n), list(n.values()))
    ood = rng.random(truth.size) < np.array([rate[t] for t in truth])
    cells = np.arange(truth.size)
    domain = np.zeros(truth.size, dtype=np.int64)

    codes, voters = sampled_clusters(emb, 0.2, 0, 15, 740)
    assert voters.sum() == 740 and codes.shape == (truth.size,)
    for t in n:  # each group one cluster, the cells outside the sample included
        assert pd.Series(codes[truth == t]).value_counts(normalize=True).iloc[0] > 0.99
    again = sampled_clusters(emb, 0.2, 0, 15, 740)
    assert np.array_equal(codes, again[0]) and np.array_equal(voters, again[1])
    small = emb[:500]
    np.testing.assert_array_equal(sampled_clusters(small, 0.2, 0, 15, 740)[0],
                                  leiden(small, 0.2, 0, n_neighbors=15))  # fmt: skip

    votes: list[dict] = []
    groups = query_ood_clusters(ood, cells, domain, lambda idx: emb[idx], resolution=0.2,
                                max_cells=740, votes=votes)  # fmt: skip
    assert sorted(pd.Series(truth[g]).mode()[0] for g in groups) == ["M", "N"]
    for g in groups:
        t = pd.Series(truth[g]).mode()[0]
        assert (truth[g] == t).mean() > 0.95 and g.size >= 0.95 * n[t]
    assert sum(v["voters"] for v in votes) == 740
    assert sum(v["cells"] for v in votes) == truth.size


def test_pearson_residuals_from_log_values_match_scanpy_on_the_counts(tmp_path):
    """The residuals rebuilt from the log-normalised matrix and each cell's counts read with it
    are scanpy's analytic Pearson residuals of the counts (theta 100, clip sqrt(n)), per batch
    where there are several; in memory and from disk alike.
    """
    import scanpy as sc

    from orca_sc._discover import PearsonResiduals

    a = orca_sc.datasets.simulate(400, 120, 4, n_batches=2, library_size=300, seed=1)
    a.obs["lab"] = np.where(np.arange(a.n_obs) % 2 == 0, a.obs["cell_type"].astype(str), None)
    cfg = OrcaConfig(n_genes=None, batch_key="batch")
    data = prepare(a, None, "lab", cfg)
    counts = sp.csr_matrix(a[:, data.genes].X, dtype=np.float64)  # run rows: input order
    np.testing.assert_allclose(data.totals, np.asarray(counts.sum(axis=1)).ravel())
    res = PearsonResiduals.fit(data.X, data.domain, data.totals, cfg.target_sum)
    got = res.rows(data.X, data.domain, np.arange(data.n_cells))
    batches = a.obs["batch"].to_numpy()[data.output_rows]
    for b in np.unique(batches):  # scanpy's residuals of each batch on its own counts
        m = batches == b
        expressed = np.asarray(counts[m].sum(axis=0)).ravel() > 0  # scanpy: 0 / 0 elsewhere
        ref = ad.AnnData(counts[m][:, expressed].toarray())
        sc.experimental.pp.normalize_pearson_residuals(ref, theta=100, clip=np.sqrt(a.n_obs))
        np.testing.assert_allclose(got[m][:, expressed], ref.X, rtol=1e-3, atol=1e-3)
        assert (got[m][:, ~expressed] == 0).all()
    a.write_h5ad(tmp_path / "a.h5ad")
    backed = ad.read_h5ad(tmp_path / "a.h5ad", backed="r")
    np.testing.assert_allclose(prepare(backed, None, "lab", cfg).totals, data.totals)
    # log-normalised input: no counts to rebuild
    logged = a.copy()
    sc.pp.normalize_total(logged, target_sum=1e4)
    sc.pp.log1p(logged)
    assert np.isnan(prepare(logged, None, "lab", cfg).totals).all()


def test_auto_pca_input_takes_the_residuals_only_where_the_labelled_cells_say_they_pay():
    """``pca_input="auto"``: at droplet depth (300 counts per cell over 1,000 genes) the labelled
    cells' nearest labelled neighbours name their type right far more often in the Pearson
    residuals, and the test says so; log-normalised input has no counts and keeps the log
    values; ``"log"`` never fits the residuals.
    """
    import scanpy as sc

    from orca_sc._context import PCA_INPUT_ALPHA, run_context

    a = orca_sc.datasets.simulate(1500, 1000, 6, library_size=300, seed=4)
    a.obs["lab"] = np.where(np.arange(a.n_obs) % 2 == 0, a.obs["cell_type"].astype(str), None)
    cfg = OrcaConfig(n_genes=None, progress=False).replace(pca_input="auto")
    rec = run_context(a, None, "lab", cfg).pca_input_record()
    assert rec["pca_input"] == "pearson" and rec["p_value"] < PCA_INPUT_ALPHA
    assert rec["knn_accuracy_pearson"] > rec["knn_accuracy_log"] + 0.1
    assert rec["right_only_pearson"] > rec["right_only_log"] and rec["n_cells"] == 750
    logged = a.copy()
    sc.pp.normalize_total(logged, target_sum=1e4)
    sc.pp.log1p(logged)
    rec = run_context(logged, None, "lab", cfg).pca_input_record()
    assert rec == {"pca_input": "log", "reason": "not every input held counts"}
    run = run_context(a, None, "lab", cfg.replace(pca_input="log"))
    assert run.pca_input == "log" and run.residuals() is None and not run._residuals


def test_a_merged_novel_sibling_is_flagged_beside_its_known_type():
    """A novel subtype of a known type correlates with the type's signature like the type
    itself and is merged into it; where the type's head kept query cells of its own, the
    permutation test flags the cluster as matching the type less well than they do, while a
    random part of the type's query cells is not flagged. The test decides nothing.
    """
    from orca_sc._discover import match_known_types
    from orca_sc.datasets import simulate

    a = simulate(3000, 600, 4, n_batches=2, subtype_of={3: 0}, imbalance=1.0, seed=4)
    t = a.obs["cell_type"].astype(str).to_numpy()
    b = a.obs["batch"].astype(str).to_numpy()
    ref = (b == "batch_0") & (t != "type_3")
    qry = b == "batch_1"
    X = sp.vstack([a.X[ref], a.X[qry]]).tocsr()
    X.data = np.log1p(X.data)
    classes = ["type_0", "type_1", "type_2"]
    labels = np.r_[[classes.index(c) for c in t[ref]], [-1] * qry.sum()]
    domain = np.r_[np.zeros(ref.sum()), np.ones(qry.sum())].astype(np.int64)
    tq = np.r_[[""] * ref.sum(), t[qry]]
    sibling = np.where(tq == "type_3", 0, -1)  # the novel subtype's cluster
    kept = np.where(tq == "type_0", 0, -1)  # its parent's query cells, kept by the parent's head
    # without the kept cells the subtype is merged into its parent: their signatures match
    alone = match_known_types(X, labels, domain, sibling, 1, 3, 0.5)
    assert [(j, k) for j, k, _ in alone] == [(0, 0)]
    tested = []
    beside = match_known_types(X, labels, domain, sibling, 1, 3, 0.5, kept=kept, tested=tested)
    assert beside == alone and tested[0]["set_apart"] and tested[0]["p_value"] <= 0.05
    assert tested[0]["n_kept"] == (tq == "type_0").sum()
    # a random part of the parent's own query cells is the parent: merged
    rng = np.random.default_rng(0)
    part = (tq == "type_0") & (rng.random(tq.size) < 0.6)
    cut = np.where(part, 0, -1)
    rest = np.where((tq == "type_0") & ~part, 0, -1)
    tested = []
    merged = match_known_types(X, labels, domain, cut, 1, 3, 0.5, kept=rest, tested=tested)
    assert [(j, k) for j, k, _ in merged] == [(0, 0)] and not tested[0]["set_apart"]
    assert tested[0]["p_value"] > 0.05


def test_a_known_type_with_few_labelled_cells_is_merged_as_with_many():
    """A type's signature from a dozen labelled cells is noisy, so it correlates less with the
    same type's cluster in another batch than the whole type's does; the merge reads the
    correlation corrected for the two signatures' reliabilities (Spearman's correction), so the
    call does not depend on how many cells carry the type. The reliability estimate matches
    the one measured against the type's signature from all its cells, and a novel type's
    cluster stays novel.
    """
    from orca_sc._discover import match_known_types
    from orca_sc._discover.naming import (
        _centred_unit,
        _signatures,
        naming_means,
        signature_reliability,
    )
    from orca_sc.datasets import simulate

    a = simulate(4000, 1000, 5, n_batches=2, library_size=1500, imbalance=1.0, seed=1)
    t = a.obs["cell_type"].astype(str).to_numpy()
    b = a.obs["batch"].astype(str).to_numpy()
    X0 = sp.csr_matrix(a.X, dtype=np.float32)
    X0.data = np.log1p(X0.data)
    # the reliability of a 24-cell mean against its share of the signature of all the cells
    ref = b == "batch_0"
    bg = np.asarray(X0[ref].mean(axis=0)).ravel()
    pool = np.flatnonzero(ref & (t == "type_0"))
    full = _centred_unit(np.asarray(X0[pool].mean(axis=0)) - bg)[0]
    rng = np.random.default_rng(0)
    truth, estimate = [], []
    for _ in range(20):
        rows = np.sort(rng.choice(pool, 24, replace=False))
        sig = _centred_unit(np.asarray(X0[rows].mean(axis=0)) - bg)[0]
        truth.append((sig @ full) ** 2)
        estimate.append(signature_reliability(X0, rows, bg, rng))
    assert 0.3 < np.mean(truth) < 0.8 and abs(np.mean(estimate) - np.mean(truth)) < 0.1
    # reference: batch 0 without type_4; query clusters: type_0 (known) and type_4 (novel)
    keep = ref & (t != "type_4")
    qry = b == "batch_1"
    X = sp.vstack([X0[keep], X0[qry]]).tocsr()
    classes = ["type_0", "type_1", "type_2", "type_3"]
    tr, tq = t[keep], t[qry]
    domain = np.r_[np.zeros(keep.sum()), np.ones(qry.sum())].astype(np.int64)
    clusters = np.r_[[-1] * keep.sum(), np.select([tq == "type_0", tq == "type_4"], [0, 1], -1)]
    every = np.array([classes.index(c) for c in tr])
    few = np.full_like(every, -1)
    for k in range(len(classes)):  # 12 labelled cells per type, the rest unlabelled
        rows = np.random.default_rng(k).choice(np.flatnonzero(every == k), 12, replace=False)
        few[rows] = k
    calls = {}
    for name, lab in (("few", few), ("every", every)):
        labels = np.r_[lab, [-1] * qry.sum()]
        bgs, cmeans, kmeans = naming_means(X, labels, domain, clusters, 2, len(classes))
        raw = _signatures(*cmeans, bgs)[0] @ _signatures(*kmeans, bgs)[0].T
        calls[name] = (raw[0, 0], match_known_types(X, labels, domain, clusters, 2, 4, 0.8))
    (raw_few, merged_few), (raw_every, merged_every) = calls["few"], calls["every"]
    assert raw_few < 0.8 <= raw_every  # uncorrected, a dozen labels would keep type_0 novel
    assert [(j, k) for j, k, _ in merged_few] == [(0, 0)] == [(j, k) for j, k, _ in merged_every]
    assert abs(merged_few[0][2] - merged_every[0][2]) < 0.1


def test_aligned_rows_are_the_affine_transform_of_each_batch_and_leave_x_alone():
    """``x * scale[batch] + offset[batch]`` for the asked rows, exactly (the same IEEE products
    and sums as NumPy's), with a scale of 1 or an offset of 0 skipped; ``X`` is not written to.
    """
    from orca_sc._align import aligned_rows

    rng = np.random.default_rng(0)
    X = sp.random(300, 50, density=0.3, format="csr", dtype=np.float32, random_state=1)
    before = X.copy()
    domain = rng.integers(0, 3, 300)
    rows = rng.choice(300, 80, replace=False)
    ones, zeros = np.ones((3, 50), np.float32), np.zeros((3, 50), np.float32)
    scale = rng.uniform(0.5, 2, (3, 50)).astype(np.float32)
    offset = rng.normal(size=(3, 50)).astype(np.float32)
    # rows of alternating batches (one index), of runs of one batch (broadcast per run; inputs
    # concatenated batch by batch) and none
    runs = np.sort(domain)
    for d, r in ((domain, rows), (runs, rows), (runs, np.sort(rows)), (domain, rows[:0])):
        dense = X[r].toarray()
        for s, o in ((ones, zeros), (ones, offset), (scale, zeros), (scale, offset)):
            got = aligned_rows(X, d, s, o, r)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, dense * s[d[r]] + o[d[r]])
    assert (X != before).nnz == 0


def test_query_mapping_fits_an_offset_on_frozen_nets_that_brings_known_query_cells_home():
    """``query_mapping="frozen"`` (a study's setting): a net trained on the reference alone is
    frozen; a query batch shifted along the reference's main axes learns an offset of its own,
    in those axes, that brings its known-type cells back to their heads (their cosine as high
    as the reference cells'); the net and the reference batch's alignment are left as they were.
    (Nothing holds back a type the reference lacks whose cells a head matches with confidence:
    the study's failure, docs/experiments.)
    """
    import torch

    from orca_sc._mapping import fit_query_offsets, reference_directions
    from orca_sc.module import OrcaNet

    rng = np.random.default_rng(2)
    g, n = 60, 150
    centroids = rng.gamma(2.0, 1.0, (3, g))
    ref = np.repeat(centroids, n, axis=0) + rng.normal(0, 0.3, (3 * n, g))
    shift = 0.3 * (centroids[0] - centroids[1])  # along the reference's own axes
    known = np.repeat(centroids, n, axis=0) + shift + rng.normal(0, 0.3, (3 * n, g))
    novel = rng.gamma(2.0, 1.0, (1, g)) + rng.normal(0, 0.3, (n, g))
    X = sp.csr_matrix(np.vstack([ref, known, novel]).astype(np.float32))
    labels = np.r_[np.repeat(np.arange(3), n), -np.ones(4 * n, dtype=int)]
    domain = np.r_[np.zeros(3 * n, dtype=int), np.ones(4 * n, dtype=int)]

    torch.manual_seed(0)
    net = OrcaNet(g, 3, (32, 16), 0.1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    xr, yr = torch.from_numpy(ref.astype(np.float32)), torch.from_numpy(labels[: 3 * n])
    for _ in range(400):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xr)[0], yr).backward()
        opt.step()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net.train()

    scale, offset = np.ones((2, g), np.float32), np.zeros((2, g), np.float32)
    new, record = fit_query_offsets([net], X, labels, domain, scale, offset, n_comps=5)

    assert net.training and all(p.requires_grad for p in net.parameters())
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert np.array_equal(new[0], offset[0])  # the reference's batch keeps its alignment
    assert set(record["batches"]) == {"1"} and record["batches"]["1"]["cells"] == 4 * n
    first, last = record["batches"]["1"]["matched_cosine"]
    assert last > first + 0.02

    def best_cosine(rows, off):
        net.eval()
        with torch.no_grad():
            z = net(torch.from_numpy((X[rows].toarray() + off).astype(np.float32)))[1]
            w = torch.nn.functional.normalize(net.head.weight, dim=1)
            return (torch.nn.functional.normalize(z, dim=1) @ w.T).max(dim=1).values.numpy()

    q_known = np.arange(3 * n, 6 * n)
    home = np.median(best_cosine(np.arange(3 * n), 0))
    moved, stayed = np.median(best_cosine(q_known, new[1])), np.median(best_cosine(q_known, 0))
    assert stayed < home - 0.04 and moved > home - 0.01  # taken away, and brought back
    # the offset lies in the reference's five principal directions and undoes the shift
    V = reference_directions(X, labels, domain, scale, offset, 5, 0).numpy().astype(np.float64)
    delta = new[1].astype(np.float64)
    assert np.linalg.norm(delta - delta @ V.T @ V) < 1e-4 * np.linalg.norm(delta)
    assert np.corrcoef(delta, -shift)[0, 1] > 0.5


def test_reference_resolution_is_the_finest_cut_that_keeps_each_labelled_type_whole():
    """``query_resolution="reference"`` (a study's setting): compact labelled types stay whole
    at a finer cut than the default; a type stretched into a continuum breaks there, so the
    same data with it get a coarser cut; the choice is made on a sample of the query's size,
    and fewer than two types to judge give the fallback.
    """
    from orca_sc._discover.graph import reference_resolution

    rng = np.random.default_rng(0)
    centres = rng.normal(0, 6, (4, 10))
    grid = (0.25, 0.5, 1.0, 2.0, 3.0, 4.0)

    def cells(stretch):
        pts = rng.normal(0, 1, (4, 250, 10))
        pts[0, :, 0] *= stretch
        return (centres[:, None, :] + pts).reshape(1000, 10), np.repeat(np.arange(4), 250)

    chosen = {}
    for stretch in (1, 6):
        emb, y = cells(stretch)
        r, whole = reference_resolution(y, np.arange(1000), 1000, emb.__getitem__, grid)
        assert whole[f"{r:g}"] == 1.0 and all(whole[f"{g:g}"] < 1 for g in grid if g > r)
        chosen[stretch] = r
    assert chosen[1] > chosen[6]
    seen = []
    r, whole = reference_resolution(
        y, np.arange(1000), 300, lambda rows: seen.append(rows.size) or emb[rows], grid
    )
    assert seen == [300] and set(whole) == {f"{g:g}" for g in grid}
    one = np.zeros(1000, dtype=int)
    assert reference_resolution(
        one, np.arange(1000), 1000, emb.__getitem__, grid, fallback=0.7
    ) == (0.7, {})
