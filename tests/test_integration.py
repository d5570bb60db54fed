"""Integration before discovery (``DiscoveryConfig.integration``): Harmony or a mutual-nearest-
neighbour correction on the joint PCA, the record of what was used, the same result for the
same seed, and the suite's figures of mixing, separation and over-correction.
"""

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import FAST, FAST_ARGS, FAST_LAB, FAST_OPTIONS, LABELS_ONLY

import orca_sc
from orca_sc import benchmark as B
from orca_sc._integrate import harmony, integrated_space, merge_order, mnn_correct


def _two_batches(seed=0):
    """A reference batch without ``type_4`` and a query batch holding every type; the batch
    effect differs by type (a shift Harmony must remove per cluster).
    """
    a = orca_sc.datasets.simulate(
        900, 300, 5, markers_per_type=30, marker_fold=5.0, n_batches=2, batch_strength=0.3,
        seed=seed,
    )  # fmt: skip
    batch = a.obs["batch"].astype(str).to_numpy()
    ref = a[(batch == "batch_0") & (a.obs["cell_type"] != "type_4").to_numpy()].copy()
    query = a[batch == "batch_1"].copy()
    return ref, query


def test_harmony_mixes_batches_and_keeps_its_seed():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 20)) * 4
    types = np.repeat(np.arange(3), 200)
    batch = np.tile(np.repeat(["a", "b"], 100), 3)
    x = centres[types] + rng.normal(size=(600, 20))
    x[batch == "b"] += 3.0  # a batch shift as large as the types' spread
    z = harmony(x, batch, seed=0)
    assert z.shape == x.shape and np.isfinite(z).all()

    def gap(e):  # distance between the batches' means of type 0, relative to its spread
        t0 = types == 0
        d = e[t0 & (batch == "a")].mean(0) - e[t0 & (batch == "b")].mean(0)
        return np.linalg.norm(d) / e[t0].std(0).mean()

    assert gap(z) < 0.5 * gap(x)
    np.testing.assert_array_equal(z, harmony(x, batch, seed=0))
    none, info = integrated_space(x, np.zeros(600), "harmony")
    assert none is None and info == {"method": "none", "reason": "one batch"}


def _shifted_types(seed=0, n=150):
    """A reference of types 0-2 and a query of types 0-3 (3 only in the query), the query
    shifted by one vector plus a part that differs by type.
    """
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(4, 12)) * 5
    shift = rng.normal(size=12) * 3 + rng.normal(size=(4, 12))
    ref_t, query_t = np.repeat([0, 1, 2], n), np.repeat([0, 1, 2, 3], n)
    x = np.vstack([centres[ref_t], centres[query_t] + shift[query_t]])
    x += rng.normal(size=x.shape)
    batch = np.repeat([0, 1], [3 * n, 4 * n])
    return x.astype(np.float32), batch, np.concatenate([ref_t, query_t])


def test_mnn_moves_shared_types_onto_the_reference_and_leaves_a_new_type_apart():
    x, batch, types = _shifted_types()
    z, record = mnn_correct(x, batch, merge_order(batch, batch == 0))
    assert z.shape == x.shape and np.isfinite(z).all() and record[0]["pairs"] > 0
    np.testing.assert_array_equal(z[batch == 0], x[batch == 0])  # the reference is kept

    def centre(e, b, t):
        return e[(batch == b) & (types == t)].mean(0)

    for t in (0, 1, 2):  # the query's cells of a shared type land on the reference's
        before = np.linalg.norm(centre(x, 1, t) - centre(x, 0, t))
        after = np.linalg.norm(centre(z, 1, t) - centre(z, 0, t))
        assert after < 0.3 * before, t
    # type 3 has no type of its own to pair with here: it lands on no reference type
    spread = np.linalg.norm(x[(batch == 0) & (types == 0)] - centre(x, 0, 0), axis=1).mean()
    for t in (0, 1, 2):
        assert np.linalg.norm(centre(z, 1, 3) - centre(z, 0, t)) > 3 * spread, t
    np.testing.assert_array_equal(z, mnn_correct(x, batch, np.array([0, 1]))[0])
    # the batches with labelled cells are merged first, whatever their codes
    assert merge_order(1 - batch, batch == 0).tolist() == [1, 0]
    _, info = integrated_space(x, batch, "mnn", labelled=batch == 0)
    assert info["method"] == "mnn" and info["pairs"][0] > 0 and info["batches"] == 2


@pytest.mark.parametrize("method", ["harmony", "mnn"])
def test_an_annotation_with_integration_records_it_and_repeats_itself(method):
    ref, query = _two_batches()
    cfg = FAST | LABELS_ONLY | {"integration": method}
    runs = []
    for _ in range(2):
        q = query.copy()
        orca_sc.tl.annotate(q, ref, labels_key="cell_type", **cfg)
        runs.append(q)
    info = runs[0].uns["orca"]["estimate"]["integration"]
    assert info["method"] == method and info["batches"] == 2
    assert info["cells"] == ref.n_obs + query.n_obs and info["n_pcs"] == 30
    assert runs[0].obs["orca_label"].equals(runs[1].obs["orca_label"])
    # type_4 (only in the query) is still found as novel in the integrated space
    novel = runs[0].obs["orca_novel"].notna().to_numpy()
    is4 = (query.obs["cell_type"] == "type_4").to_numpy()
    assert novel[is4].mean() > 0.8 and novel[~is4].mean() < 0.1
    if method != "harmony":
        return
    # the default reads the PCA of each cell set and, on counts, decides what the PCA reads
    # with the labelled cells' test, and says so
    q = query.copy()
    orca_sc.tl.annotate(q, ref, labels_key="cell_type", **(FAST | LABELS_ONLY))
    space = q.uns["orca"]["estimate"]["integration"]
    assert space["method"] == "none" and space["asked"] == "auto"
    assert space["pca_input"] == ("pearson" if space["p_value"] < 0.05 else "log")
    assert 0 < space["n_cells"] <= ref.n_obs


def test_integration_option_is_checked():
    with pytest.raises(orca_sc.OrcaInputError, match="integration"):
        orca_sc.OrcaConfig().replace(integration="scvi")


def test_integration_figures_see_mixing_and_over_correction():
    ref, query = _two_batches(seed=1)
    ref.obs["cell_type"] = ref.obs["cell_type"].astype(str)
    query.obs["_truth"] = query.obs["cell_type"].astype(str)
    seen = sorted(set(ref.obs["cell_type"]))
    task = B.Task("two_batches", ref, query, "cell_type", seen, single=False)
    f = B.integration_figures(task, seed=0)
    for k in ("mix", "sep_qshare", "sep_knn", "over"):
        assert 0 <= f[f"{k}_pca"] <= 1 and 0 <= f[f"{k}_harmony"] <= 1, k
    assert f["mix_harmony"] > f["mix_pca"]  # the batches mix once integrated
    assert f["sep_knn_pca"] > 0.9  # the novel type lies far from every reference cell
    # a "novel" type that the reference does have: it is pulled onto it (over-correction 1)
    fake = B.Task("fake", ref, query[query.obs["cell_type"] != "type_4"].copy(), "cell_type",
                  [s for s in seen if s != "type_0"], single=False)  # fmt: skip
    g = B.integration_figures(fake, seed=0)
    assert g["over_harmony"] > 0.9 and g["over_harmony"] >= g["over_pca"]


def _truth_rep(adata, as_type=None, width=8, seed=0):
    """An embedding that places each cell at its true type's point (plus a little noise);
    ``as_type``: types drawn at another type's point (an embedding that merges them).
    """
    rng = np.random.default_rng(seed)
    centres = {f"type_{i}": rng.normal(size=width) * 5 for i in range(5)}
    types = adata.obs["cell_type"].astype(str).map(lambda t: (as_type or {}).get(t, t))
    return np.stack([centres[t] for t in types]) + rng.normal(size=(adata.n_obs, width)) * 0.1


def test_use_rep_is_the_space_discovery_reads():
    """``use_rep``: discovery reads the user's joint embedding. One that keeps ``type_4`` apart
    finds it; one that draws ``type_4`` onto ``type_0`` makes it no candidate of its own, although
    the expression is the same.
    """
    ref, query = _two_batches()
    is4 = (query.obs["cell_type"] == "type_4").to_numpy()
    out = {}
    for name, merge in (("apart", None), ("merged", {"type_4": "type_0"})):
        r, q = ref.copy(), query.copy()
        r.obsm["X_emb"] = _truth_rep(r, merge, seed=1)
        q.obsm["X_emb"] = _truth_rep(q, merge, seed=2)
        orca_sc.tl.annotate(q, r, labels_key="cell_type", use_rep="X_emb", **(FAST | LABELS_ONLY))
        assert q.uns["orca"]["estimate"]["integration"] == {
            "method": "use_rep", "key": "X_emb", "width": 8,
        }  # fmt: skip
        assert q.uns["orca"]["params"]["discovery"]["use_rep"] == "X_emb"
        out[name] = q.obs["orca_novel"].notna().to_numpy()
    assert out["apart"][is4].mean() > 0.8 and out["apart"][~is4].mean() < 0.1
    assert out["merged"][is4].mean() < 0.2


def test_use_rep_is_checked_before_any_work(tmp_path):
    from click.testing import CliRunner
    from conftest import FAST_ARGS, assert_cli_error

    from orca_sc.cli import main

    ref, query = _two_batches()
    ref.obsm["X_emb"] = np.zeros((ref.n_obs, 4), dtype=np.float32)

    def err(q, **kw):
        with pytest.raises(orca_sc.OrcaInputError) as e:
            orca_sc.tl.annotate(q, ref, labels_key="cell_type", **(FAST | kw))
        assert "orca" not in q.obs and "orca" not in q.uns  # nothing written
        return str(e.value)

    msg = err(query.copy(), use_rep="X_emb")
    assert "'X_emb' is not in the query's obsm" in msg and "holds nothing" in msg
    q = query.copy()
    q.obsm["X_emb"] = np.zeros((q.n_obs, 6), dtype=np.float32)
    assert "'reference': 4, 'query': 6" in err(q, use_rep="X_emb")
    q.obsm["X_emb"] = np.zeros((q.n_obs, 4), dtype=np.float32)
    q.obsm["X_emb"][3, 1] = np.nan
    assert "holds 1 non-finite value" in err(q, use_rep="X_emb")
    assert "use_rep" in err(query.copy(), use_rep="X_emb", integration="harmony")
    # the CLI: one line on stderr, exit 2, nothing written
    ref.write_h5ad(tmp_path / "ref.h5ad")
    query.write_h5ad(tmp_path / "q.h5ad")
    r = CliRunner().invoke(main, ["annotate", str(tmp_path / "ref.h5ad"), str(tmp_path / "q.h5ad"),
                                  "--labels-key", "cell_type", "--use-rep", "X_emb",
                                  "-o", str(tmp_path / "out.h5ad"), *FAST_ARGS])  # fmt: skip
    assert_cli_error(r, "'X_emb' is not in the query's obsm")
    assert not (tmp_path / "out.h5ad").exists()


def test_cli_pca_input_pearson_is_what_discovery_reads(small_sim, tmp_path):
    """``--pca-input pearson`` on counts: discovery's PCA reads the Pearson residuals and the
    record says so; on log-normalised input the log values, with the reason.
    """
    import anndata as ad
    import scanpy as sc

    from orca_sc.cli import main

    lab = small_sim.obs["lab"].notna().to_numpy()
    ref, query = small_sim[lab].copy(), small_sim[~lab].copy()
    ref.obs["lab"] = ref.obs["lab"].astype(str)
    del query.obs["lab"]
    ref.write_h5ad(tmp_path / "ref.h5ad")
    query.write_h5ad(tmp_path / "query.h5ad")
    r = CliRunner().invoke(main, ["annotate", str(tmp_path / "ref.h5ad"),
                                  str(tmp_path / "query.h5ad"), "--labels-key", "lab",
                                  "--pca-input", "pearson", "-o", str(tmp_path / "out.h5ad"),
                                  "--novelty-folds", "0", *FAST_ARGS])  # fmt: skip
    assert r.exit_code == 0, r.output
    space = ad.read_h5ad(tmp_path / "out.h5ad").uns["orca"]["estimate"]["integration"]
    assert space["pca_input"] == "pearson" and space["method"] == "none"
    logged = small_sim.copy()
    sc.pp.normalize_total(logged, target_sum=1e4)
    sc.pp.log1p(logged)
    orca_sc.tl.annotate(logged, labels_key="lab", pca_input="pearson", **FAST, **LABELS_ONLY)
    space = logged.uns["orca"]["estimate"]["integration"]
    assert space["pca_input"] == "log" and space["reason"] == "not every input held counts"


def test_the_pca_input_test_names_each_labelled_cell_by_its_nearest_labelled_cells():
    """``pca_input="auto"``'s accuracies are those of each labelled cell's majority type among
    its ``n_neighbors`` nearest labelled cells (itself left out) in each PCA, as documented
    (types close enough that some cells are named wrong, so that the neighbours matter).
    """
    from conftest import open_world
    from sklearn.neighbors import NearestNeighbors

    from orca_sc._context import choose_pca_input, run_context
    from orca_sc._discover import pca_embedding

    a = orca_sc.datasets.simulate(600, 300, 5, markers_per_type=30, marker_fold=1.5, seed=3)
    a = open_world(a, ["type_0", "type_1", "type_2"])
    run = run_context(a, None, "lab", orca_sc.OrcaConfig(**FAST_OPTIONS), FAST_LAB)
    record = choose_pca_input(run, run.residuals_fit())
    d, t, k = run.data, run.transform, run.config.discovery.n_neighbors
    lab = np.flatnonzero(d.labels >= 0)
    y = d.labels[lab]
    for res, key in ((None, "knn_accuracy_log"), (run.residuals_fit(), "knn_accuracy_pearson")):
        z = pca_embedding(d.X, d.domain, t.scale, t.offset, n_comps=run.rules.n_pcs,
                          seed=run.config.seed, rows=lab, residuals=res)  # fmt: skip
        nb = y[NearestNeighbors(n_neighbors=k).fit(z).kneighbors(return_distance=False)]
        votes = np.stack([(nb == c).sum(axis=1) for c in range(int(y.max()) + 1)], axis=1)
        assert record[key] == pytest.approx(float((votes.argmax(axis=1) == y).mean()))
    assert record["knn_accuracy_log"] < 0.9 and record["n_cells"] == lab.size
