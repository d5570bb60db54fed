"""orca_sc.pl plots and the Tabula Muris cross-tissue task builder."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scanpy as sc  # noqa: E402
from conftest import FAST, LABELS_ONLY, SHARED_DATA  # noqa: E402

import orca_sc  # noqa: E402
from orca_sc import OrcaInputError  # noqa: E402
from orca_sc._colors import NOVEL, label_colors  # noqa: E402


@pytest.fixture(scope="module")
def annotated(small_run):
    """The shared run with a 2-D layout of ``X_orca`` in ``obsm['X_umap']``: its first two
    principal components stand in for a UMAP (the plots read the coordinates whatever made
    them; the demo's test runs scanpy's UMAP, whose first call compiles for ~13 s).
    """
    a = small_run.adata()
    a.obsm["X_umap"] = sc.pp.pca(a.obsm["X_orca"], n_comps=2, random_state=0)
    return a


def test_embedding_highlights_novel_clusters(annotated, tmp_path):
    ax = orca_sc.pl.embedding(annotated, show=False)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    novel = list(annotated.obs["orca_novel"].cat.categories)
    assert novel and all(f"{n} (novel)" in legend for n in novel)
    # novel clusters are drawn last (on top), with an outline
    assert ax.collections[-1].get_label().endswith("(novel)")
    assert ax.collections[-1].get_linewidths()[0] > 0
    plt.close("all")
    figdir, fmt = sc.settings.figdir, sc.settings.file_format_figs
    try:  # saved as scanpy saves: under sc.settings.figdir, named after the plot
        sc.settings.figdir, sc.settings.file_format_figs = tmp_path, "png"
        orca_sc.pl.embedding(annotated, save="_e.png")
        assert orca_sc.pl.confidence(annotated, save=True) is None  # saved, then shown
    finally:
        sc.settings.figdir, sc.settings.file_format_figs = figdir, fmt
    assert (tmp_path / "embedding_e.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "confidence.png").read_bytes()[:4] == b"\x89PNG"
    plt.close("all")
    with pytest.raises(KeyError, match="sc.tl.tsne"):
        orca_sc.pl.embedding(annotated, basis="tsne", show=False)


def test_correspondence_counts_match_crosstab(annotated):
    ax = orca_sc.pl.correspondence(annotated, "cell_type", show=False)
    img = ax.images[0].get_array()
    assert np.allclose(np.asarray(img).sum(axis=1), 1.0)  # row-normalised
    texts = {t.get_text() for t in ax.texts}
    top = annotated.obs.groupby(["cell_type", "orca_label"], observed=True).size().max()
    assert str(top) in texts
    plt.close("all")
    with pytest.raises(KeyError, match="truth_key 'nope'"):
        orca_sc.pl.correspondence(annotated, "nope", show=False)


def test_confidence_and_marker_dotplot(annotated):
    ax = orca_sc.pl.confidence(annotated, show=False)
    assert [t.get_text() for t in ax.get_xticklabels()] == list(
        annotated.obs["orca_label"].cat.categories
    )
    dp = orca_sc.pl.novel_markers(annotated, n_genes=3, show=False)
    assert set(dp.var_names) >= set(
        orca_sc.tl.summarize(annotated, n_markers=3)["novel"][0]["markers"]
    )
    plt.close("all")


def _hex(rgba):
    from matplotlib.colors import to_hex

    return to_hex(rgba)


def test_one_colour_per_label_across_panels_and_runs(annotated):
    """A label has one colour: in ``uns['orca_label_colors']``, on every ``pl`` panel, on
    scanpy's panel of the truth (``match_colors``) and in another run on the same reference
    whose query lacks some types; novel clusters are coloured from a palette of their own.
    """
    cats = list(annotated.obs["orca_label"].cat.categories)
    colors = dict(zip(cats, annotated.uns["orca_label_colors"], strict=True))
    novel = list(annotated.obs["orca_novel"].cat.categories)
    assert novel and len(set(colors.values())) == len(cats)
    assert annotated.uns["orca_novel_colors"] == [colors[n] for n in novel]
    ax = orca_sc.pl.embedding(annotated, show=False)
    for coll in ax.collections:
        label = coll.get_label().removesuffix(" (novel)")
        assert _hex(coll.get_facecolor()[0]) == colors[label]
    plt.close("all")
    ax = orca_sc.pl.confidence(annotated, show=False)
    faces = [_hex(p.get_facecolor()) for p in ax.patches]
    assert faces == [colors[c] for c in cats]
    plt.close("all")
    # the truth panel: known types as orca_label colours them, the hidden types in other tones
    truth = orca_sc.pl.match_colors(annotated, "cell_type")
    by_truth = dict(zip(annotated.obs["cell_type"].cat.categories, truth, strict=True))
    for t in ("type_0", "type_1", "type_2"):
        assert by_truth[t] == colors[t]
    for t in ("type_3", "type_4"):
        assert by_truth[t] not in colors.values()
    # another query on the same reference, without type_1: the other types keep their colour
    a = orca_sc.datasets.simulate(500, 300, 5, markers_per_type=30, marker_fold=5.0, seed=3)
    ref = a[a.obs["cell_type"].isin(["type_0", "type_1", "type_2"])][:150].copy()
    q1 = a[150:].copy()
    q2 = q1[q1.obs["cell_type"] != "type_1"].copy()
    for q in (q1, q2):
        orca_sc.tl.annotate(q, ref, labels_key="cell_type", **FAST, **LABELS_ONLY)
    c1, c2 = (dict(zip(q.obs["orca_label"].cat.categories, q.uns["orca_label_colors"],
                       strict=True)) for q in (q1, q2))  # fmt: skip
    assert c1["type_0"] == c2["type_0"] and c1["type_2"] == c2["type_2"]
    classes = ["type_0", "type_1", "type_2"]  # a type's colour does not depend on which are present
    assert label_colors(["type_2", "novel_1"], classes, ["novel_1"]) == [c1["type_2"], NOVEL[0]]
    known = {c1[t] for t in ("type_0", "type_1", "type_2")}
    assert not known & {c for n, c in c1.items() if n.startswith("novel_")}


def test_cross_tissue_task_builder():
    a = orca_sc.datasets.simulate(1200, 300, 6, markers_per_type=30, n_batches=3, seed=2)
    a.obs["tissue"] = a.obs["batch"].astype(str).str.replace("batch", "tissue")
    a.obs["cell_ontology_class"] = a.obs["cell_type"].astype(str)
    ref, query = orca_sc.datasets.tabula_muris_cross_tissue(
        a, query_tissues=["tissue_2"], min_cells=50, n_genes=200, seed=0
    )
    info = query.uns["orca_task"]
    assert info["query_tissues"] == ["tissue_2"] and info["reference_tissues"] == [
        "tissue_0",
        "tissue_1",
    ]
    assert len(info["seen_classes"]) == 3 and ref.n_vars == query.n_vars == 200
    assert set(ref.obs["cell_ontology_class"]) <= set(info["seen_classes"])
    assert (ref.obs["tissue"] != "tissue_2").all() and (query.obs["tissue"] == "tissue_2").all()
    assert set(info["novel_classes"]) == set(query.obs["cell_ontology_class"]) - set(
        info["seen_classes"]
    )
    # log-normalised on all genes (10^4 per cell + log1p), then restricted to the selected genes
    raw = a[ref.obs_names[:5]].X.toarray()
    expect = np.log1p(1e4 * raw / raw.sum(axis=1, keepdims=True))[
        :, a.var_names.get_indexer(ref.var_names)
    ]
    np.testing.assert_allclose(ref.X[:5].toarray(), expect, rtol=1e-4, atol=1e-5)
    # min_cells drops rare types; default query tissues are half of them
    small = a[~((a.obs["cell_type"] == "type_5").to_numpy() & (np.arange(a.n_obs) % 4 > 0))].copy()
    r2, q2 = orca_sc.datasets.tabula_muris_cross_tissue(small, min_cells=60, n_genes=None, seed=1)
    assert "type_5" not in set(q2.obs["cell_ontology_class"]) | set(r2.obs["cell_ontology_class"])
    assert len(q2.uns["orca_task"]["query_tissues"]) == 1
    with pytest.raises(OrcaInputError, match="query tissues \\['lung'\\] not found"):
        orca_sc.datasets.tabula_muris_cross_tissue(a, query_tissues=["lung"], min_cells=50)
    with pytest.raises(OrcaInputError, match="lower min_cells"):
        orca_sc.datasets.tabula_muris_cross_tissue(a, min_cells=10_000)


@pytest.mark.skipif(not (SHARED_DATA / "tm_facs_scfind.h5ad").exists(), reason="shared data absent")
def test_cross_tissue_on_real_tabula_muris():
    a = sc.read_h5ad(SHARED_DATA / "tm_facs_scfind.h5ad")
    ref, query = orca_sc.datasets.tabula_muris_cross_tissue(
        a, labels_key="cell_type", query_tissues=["Marrow"], seen_fraction=None, min_cells=5,
        n_genes=2000,
    )  # fmt: skip
    info = query.uns["orca_task"]
    assert "unannotated" not in set(query.obs["cell_type"]) | set(ref.obs["cell_type"])
    assert info["novel_classes"] == [
        "immature B cell",
        "late pro-B cell",
        "naive B cell",
        "precursor B cell",
    ]
    assert "macrophage" in info["seen_classes"]
