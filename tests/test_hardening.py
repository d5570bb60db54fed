"""No silent wrong result, no exit-1 path, the caller's objects untouched (issue 21).

One test per defect found by trying bad or unusual inputs as a new user would; the property-based
test at the end (``test_fuzz_*``) keeps the contract for inputs nobody listed.
"""

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
import scipy.sparse as sp
from click.testing import CliRunner
from conftest import FAST, FAST_ARGS, LABELS_ONLY, assert_cli_error

import orca_sc
from orca_sc import OrcaInputError
from orca_sc._discover import name_heads
from orca_sc._labels import _is_unlabeled
from orca_sc._read import detect_scale, get_matrix
from orca_sc.cli import main

SEEN = ["type_0", "type_1", "type_2"]


def _split(seed=3, n=600):
    a = orca_sc.datasets.simulate(n, 300, 5, markers_per_type=30, marker_fold=5.0, seed=seed)
    a.X = sp.csr_matrix(a.X)
    rng = np.random.default_rng(0)
    in_ref = a.obs["cell_type"].isin(SEEN).to_numpy() & (rng.random(a.n_obs) < 0.5)
    ref, query = a[in_ref].copy(), a[~in_ref].copy()
    query.obs["truth"] = query.obs["cell_type"].astype(str)
    del query.obs["cell_type"]
    return ref, query


def _snapshot(adata):
    """Everything of an AnnData a call could change, as plain copies."""
    X = adata.X
    parts = (X.data, X.indices, X.indptr) if sp.issparse(X) else (X,)
    return {
        "X": [np.array(p, copy=True) for p in parts],
        "X_type": (type(X), X.dtype, getattr(X, "has_sorted_indices", None)),
        "obs": adata.obs.copy(deep=True),
        "var": adata.var.copy(deep=True),
        "obsm": set(adata.obsm.keys()),
        "uns": set(adata.uns.keys()),
        "layers": set(adata.layers.keys()),
    }


def assert_unchanged(adata, snap):
    X = adata.X
    parts = (X.data, X.indices, X.indptr) if sp.issparse(X) else (X,)
    assert len(parts) == len(snap["X"])
    for a, b in zip(parts, snap["X"], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    assert (type(X), X.dtype) == snap["X_type"][:2]
    pd.testing.assert_frame_equal(adata.obs, snap["obs"])
    pd.testing.assert_frame_equal(adata.var, snap["var"])
    assert set(adata.obsm.keys()) == snap["obsm"]
    assert set(adata.uns.keys()) == snap["uns"]
    assert set(adata.layers.keys()) == snap["layers"]


def _invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ------------------------------------------------------ 1 + 2: class names and missing labels
def test_novel_clusters_never_take_a_known_types_name():
    names, order = name_heads(np.array([3, 9, 0, 5]), ["a", "novel_1", "novel_3"], [])
    assert names == ["a", "novel_1", "novel_3", "novel_5", "novel_2", None, "novel_4"]
    assert [names[3 + h] for h in order] == ["novel_2", "novel_4", "novel_5"]


def test_missing_label_spellings_are_unlabelled():
    col = pd.Series(["B", "nan", "NaN", "", " ", "None", "null", None, np.nan, "Unknown", "nano"])
    assert _is_unlabeled(col, ("Unknown",)).tolist() == [False] + [True] * 9 + [False]
    cat = pd.Series(pd.Categorical(["B", "nan", "T", "NaN"]))
    assert _is_unlabeled(cat, ()).tolist() == [False, True, False, True]


def test_reference_that_is_an_annotated_query(tmp_path):
    """A reference with a class ``novel_1`` (an annotated query reused) and label strings that
    mean missing: the run's own novel clusters get other names, 'nan' is no cell type, and the
    result round-trips through h5ad and ``orca-sc predict``.
    """
    ref, query = _split()
    labels = ref.obs["cell_type"].astype(str).replace({"type_0": "novel_1"}).to_numpy()
    labels[:15] = "nan"
    labels[15:25] = ""
    ref.obs["cell_type"] = pd.Categorical(labels)
    ref_path = tmp_path / "ref.h5ad"
    ref.write_h5ad(ref_path)
    query.write_h5ad(tmp_path / "q.h5ad")
    # through the command line (which runs tl.annotate), then predict with the saved model
    r = _invoke(["annotate", ref_path, tmp_path / "q.h5ad", "--labels-key", "cell_type",
                 "-o", tmp_path / "cli.h5ad", "--save-model", tmp_path / "m.pt", *FAST_ARGS])  # fmt: skip
    assert r.exit_code == 0, r.output
    out = ad.read_h5ad(tmp_path / "cli.h5ad")
    uns = out.uns["orca"]
    assert list(uns["seen_classes"]) == ["novel_1", "type_1", "type_2"]
    assert uns["data"]["n_labeled"] == ref.n_obs - 25
    labels_out = set(out.obs["orca_label"].astype(str))
    assert "nan" not in labels_out and "" not in labels_out
    novel = out.obs["orca_novel"].cat.categories.tolist()
    assert novel and "novel_1" not in novel, novel
    truth = query.obs["truth"].to_numpy()
    # query cells of type_0 go to the known type named novel_1, not to a novel cluster
    called = out.obs["orca_label"].astype(str).to_numpy()[truth == "type_0"]
    assert (called == "novel_1").mean() > 0.9
    assert out.obs["orca_novel"][truth == "type_0"].isna().mean() > 0.9
    r = _invoke(["predict", tmp_path / "m.pt", tmp_path / "q.h5ad", "-o", tmp_path / "p.h5ad"])
    assert r.exit_code == 0, r.output
    cli = ad.read_h5ad(tmp_path / "cli.h5ad").obs["orca_label"].astype(str)
    pred = ad.read_h5ad(tmp_path / "p.h5ad").obs["orca_label"].astype(str)
    assert (cli.to_numpy() == pred.to_numpy()).all()


# --------------------------------------------------------- 4: options validated up front
@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("lr", float("inf"), "Invalid lr=inf"),
        ("lr", 1e30, "Invalid lr=1e+30"),
        ("lr", float("nan"), "Invalid lr=nan"),
        ("seed", -1, "Invalid seed=-1"),
        ("target_sum", float("inf"), "Invalid target_sum=inf"),
        ("device", "cuda:x", "Invalid device='cuda:x'"),
        ("resolution", float("inf"), "Invalid resolution=inf"),
    ],
)
def test_bad_options_fail_before_any_work(option, value, fragment, monkeypatch):
    import orca_sc._context as pipeline

    def no_work(*args, **kwargs):
        raise AssertionError("data were prepared before the options were checked")

    monkeypatch.setattr(pipeline, "prepare", no_work)
    ref, query = _split(n=100)
    with pytest.raises(OrcaInputError, match=fragment.replace("(", r"\(").replace("+", r"\+")):
        orca_sc.tl.annotate(query, ref, labels_key="cell_type", **{option: value})


def test_n_novel_beyond_the_cells_is_refused_before_training(monkeypatch):
    import orca_sc._pipeline as pipeline

    class Trained(Exception):
        pass

    def stop(*args, **kwargs):
        raise Trained

    monkeypatch.setattr(pipeline, "fit_warmup", stop)
    ref, query = _split(n=300)
    n_query = query.n_obs
    with pytest.raises(
        OrcaInputError, match=f"Invalid n_novel=1000000000: expected at most {n_query}"
    ):
        orca_sc.tl.annotate(query, ref, labels_key="cell_type", n_novel=10**9, **FAST)
    with pytest.warns(UserWarning, match="fewer than 5 cells per type"):
        with pytest.raises(Trained):  # the warning comes before training (stubbed out here)
            orca_sc.tl.annotate(query, ref, labels_key="cell_type", n_novel=n_query // 2, **FAST)


def test_short_runs_shorten_the_warm_up():
    from orca_sc._config import resolve_config

    assert resolve_config(None, "t", epochs=2).warmup_epochs == 1
    assert resolve_config(None, "t", epochs=1).warmup_epochs == 0
    assert resolve_config(None, "t", epochs=6).warmup_epochs == 5  # default kept where it fits
    with pytest.raises(
        OrcaInputError, match=r"Invalid warmup_epochs=3: expected smaller than epochs=2"
    ):
        resolve_config(None, "t", epochs=2, warmup_epochs=3)


# ----------------------------------------------------------------- 5: the value scale
def test_normalised_but_not_logged_is_refused():
    """``normalize_total`` without ``log1p`` (values below the old max>50 rule) is an error that
    says to run log1p; the same data logged, or subset to a few genes, are read right.
    """
    a = orca_sc.datasets.simulate(300, 400, 4, seed=0)
    counts = sp.csr_matrix(a.X, dtype=np.float32)
    assert detect_scale(counts) == "counts"
    for target in (50.0, 10.0, 1e4 / 300):
        n = a.copy()
        sc.pp.normalize_total(n, target_sum=target)
        X = sp.csr_matrix(n.X, dtype=np.float32)
        with pytest.raises(OrcaInputError, match=r"normalised but not log-transformed.*log1p"):
            detect_scale(X)
        with pytest.raises(OrcaInputError, match="normalised but not log-transformed"):
            detect_scale(X[:, :60].tocsr())  # row sums no longer constant
        sc.pp.log1p(n)
        assert detect_scale(sp.csr_matrix(n.X, dtype=np.float32)) == "log-normalized"
        assert (
            detect_scale(sp.csr_matrix(n.X, dtype=np.float32)[:, :60].tocsr()) == "log-normalized"
        )


def test_real_log_normalised_data_are_read_as_such():
    pbmc = sc.datasets.pbmc68k_reduced()  # shipped with scanpy: log-normalised raw matrix
    assert detect_scale(sp.csr_matrix(pbmc.raw.X, dtype=np.float32)) == "log-normalized"


# ------------------------------------------------------------ 6: the caller's objects
def _unsorted_with_duplicates(X):
    """The same matrix with each row's columns in reverse order and its first entry split into
    two duplicates (a valid but non-canonical CSR matrix).
    """
    X = sp.csr_matrix(X, dtype=np.float32)
    rows = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))
    order = np.lexsort((-X.indices, rows))
    data, cols = X.data[order].copy(), X.indices[order]
    data[0] /= 2
    data, cols = np.insert(data, 1, data[0]), np.insert(cols, 1, cols[0])
    counts = np.diff(X.indptr)
    counts[rows[order][0]] += 1
    out = sp.csr_matrix((data, cols, np.concatenate([[0], np.cumsum(counts)])), shape=X.shape)
    assert not out.has_canonical_format
    assert np.allclose(out.toarray(), X.toarray())
    return out


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"seed": -1}, "Invalid seed=-1"),
        ({"device": "cuda:7"}, "Invalid device='cuda:7'"),
        ({"labels_key": "nope"}, "labels_key 'nope' is not a column"),
        ("all_labelled", "no unlabelled cells"),
        ({"n_novel": 10**6}, "Invalid n_novel=1000000"),
    ],
)
def test_caller_objects_untouched_when_a_call_fails(bad, match):
    ref, query = _split(n=200)
    query.X = _unsorted_with_duplicates(query.X)
    ref.X = _unsorted_with_duplicates(ref.X)
    kwargs = {"labels_key": "cell_type", **FAST}
    adata, reference = query, ref
    if bad == "all_labelled":
        adata, reference = ref, None
    else:
        kwargs.update(bad)
    snaps = [_snapshot(x) for x in (adata, reference) if x is not None]
    with pytest.raises(OrcaInputError, match=match):
        orca_sc.tl.annotate(adata, reference, **kwargs)
    for x, snap in zip([x for x in (adata, reference) if x is not None], snaps, strict=True):
        assert_unchanged(x, snap)


def test_caller_objects_untouched_by_a_run_except_the_documented_fields():
    """A successful run writes only obs['orca_*'], obsm['X_orca'] and uns['orca'] into the query
    and nothing into the reference; a non-canonical sparse .X (unsorted, duplicates) is left
    exactly as it was, in both modes.
    """
    ref, query = _split(n=400)
    query.X = _unsorted_with_duplicates(query.X)
    ref.X = _unsorted_with_duplicates(ref.X)
    snap_q, snap_r = _snapshot(query), _snapshot(ref)
    orca_sc.tl.annotate(query, ref, labels_key="cell_type", **FAST)
    assert_unchanged(ref, snap_r)
    new_obs = [c for c in query.obs.columns if c not in snap_q["obs"].columns]
    assert sorted(new_obs) == [
        "orca_confidence", "orca_label", "orca_novel", "orca_novelty", "orca_novelty_pvalue",
        "orca_novelty_qvalue",
    ]  # fmt: skip
    query.obs = query.obs.drop(columns=new_obs)
    assert set(query.obsm.keys()) - snap_q["obsm"] == {"X_orca"}
    ours = {"orca", "orca_label_colors", "orca_novel_colors"}
    assert set(query.uns.keys()) - snap_q["uns"] == ours
    del query.obsm["X_orca"]
    for k in ours:
        del query.uns[k]
    assert_unchanged(query, snap_q)
    # single-AnnData mode on a dense float64 matrix with a layer
    single = ad.concat([ref, query[:100]], join="inner")
    single.obs["cell_type"] = pd.Categorical(list(ref.obs["cell_type"].astype(str)) + [None] * 100)
    single.layers["counts"] = single.X.toarray().astype(np.float64)
    snap = _snapshot(single)
    layer_before = single.layers["counts"].copy()
    orca_sc.tl.annotate(single, labels_key="cell_type", layer="counts", **FAST)
    assert np.array_equal(single.layers["counts"], layer_before)
    single.obs = single.obs.drop(columns=[c for c in single.obs if c.startswith("orca_")])
    del single.obsm["X_orca"]
    for k in ours:
        del single.uns[k]
    assert_unchanged(single, snap)


# ---------------------------------------------------------------------- 7: clear messages
def test_value_messages_say_what_is_wrong():
    ref, query = _split(n=100)
    zero = query.copy()
    zero.X = sp.csr_matrix(zero.shape, dtype=np.float32)
    with pytest.raises(OrcaInputError, match=r"The query .X holds only zeros"):
        orca_sc.tl.annotate(zero, ref, labels_key="cell_type")
    huge = query.copy()
    huge.X = huge.X.astype(np.float64)
    huge.X.data[0] = 1e39
    with pytest.raises(OrcaInputError, match=r"values up to 1e\+39, beyond what float32 can hold"):
        orca_sc.tl.annotate(huge, ref, labels_key="cell_type")
    other = query.copy()
    other.var_names = list(ref.var_names[:150]) + [f"x{i}" for i in range(other.n_vars - 150)]
    keep = np.r_[np.zeros(150), np.ones(other.n_vars - 150)]
    other.X = sp.csr_matrix(other.X @ sp.diags(keep))  # no expression in the shared genes
    with pytest.raises(OrcaInputError, match="the query have no non-zero values in the 150 genes"):
        orca_sc.tl.annotate(other, ref, labels_key="cell_type")
    text = query.copy()
    text.X = np.full(text.shape, "1", dtype=object)
    with pytest.raises(OrcaInputError, match="has dtype object; expression values must be numbers"):
        get_matrix(text, None, "query")


def test_objects_that_are_not_anndata_name_the_fix():
    """Several AnnData, a DataFrame or a path where one AnnData is expected: one OrcaInputError
    that says what to pass instead (not ``AttributeError: 'list' object has no attribute ...``).
    """
    ref, query = _split(n=100)
    cases = [
        (lambda: orca_sc.OrcaModel.fit([query, query], ref, labels_key="cell_type"),
         r"adata must be an AnnData, got a list of 2 objects; .*anndata.concat"),
        (lambda: orca_sc.tl.annotate([query, query], ref, labels_key="cell_type"),
         r"The same AnnData is given twice in adata; pass each query once"),
        (lambda: orca_sc.tl.annotate([query, query.to_df()], ref, labels_key="cell_type"),
         r"adata\[1\] must be an AnnData, got a pandas DataFrame"),
        (lambda: orca_sc.tl.annotate(query.to_df(), ref, labels_key="cell_type"),
         r"adata must be an AnnData or a list of them, got a pandas DataFrame; wrap it as anndata.AnnData\(df\)"),
        (lambda: orca_sc.tl.annotate(query, ref.to_df(), labels_key="cell_type"),
         r"reference must be an AnnData, got a pandas DataFrame"),
        (lambda: orca_sc.OrcaModel.fit("query.h5ad", ref, labels_key="cell_type"),
         r"adata must be an AnnData, got a path \('query.h5ad'\); read it first"),
    ]  # fmt: skip
    for call, match in cases:
        with pytest.raises(OrcaInputError, match=match):
            call()


def test_backed_query_with_copy_is_refused_and_runs_without(tmp_path):
    ref, query = _split(n=300)
    query.write_h5ad(tmp_path / "q.h5ad")
    before = (tmp_path / "q.h5ad").read_bytes()
    backed = ad.read_h5ad(tmp_path / "q.h5ad", backed="r")
    with pytest.raises(OrcaInputError, match="copy=True cannot copy an AnnData opened in backed"):
        orca_sc.tl.annotate(backed, ref, labels_key="cell_type", copy=True, **FAST)
    orca_sc.tl.annotate(backed, ref, labels_key="cell_type", **FAST, **LABELS_ONLY)
    assert backed.obs["orca_label"].notna().all() and backed.obsm["X_orca"].shape[0] == query.n_obs
    assert (tmp_path / "q.h5ad").read_bytes() == before  # the file itself is not written


def test_label_columns_that_are_not_cell_types():
    """A continuous column or a per-cell identifier given as labels_key is refused (it used to
    run as hundreds of one-cell classes); integer codes stored as floats are cell types.
    """
    ref, query = _split(n=400)
    ref.obs["score"] = np.random.default_rng(0).random(ref.n_obs)
    with pytest.raises(OrcaInputError, match=r"obs\['score'\] of the reference holds continuous "
                       r"numbers .* Columns that could hold them: 'cell_type'"):  # fmt: skip
        orca_sc.tl.annotate(query, ref, labels_key="score", **FAST)
    ref.obs["barcode"] = [f"AAC{i}" for i in range(ref.n_obs)]
    with pytest.raises(OrcaInputError, match=r"holds a value per cell \(\d+ distinct values"):
        orca_sc.tl.annotate(query, ref, labels_key="barcode", **FAST)
    ref.obs["code"] = ref.obs["cell_type"].cat.codes.astype(float)
    out = orca_sc.tl.annotate(query, ref, labels_key="code", copy=True, **FAST, **LABELS_ONLY)
    known = out.obs["orca_label"][~out.obs["orca_label"].isin(out.obs["orca_novel"].dropna())]
    assert set(known.astype(str)) <= {"0.0", "1.0", "2.0"}
    single = ad.concat([ref, query], join="inner")
    single.obs["score"] = [*ref.obs["score"], *[np.nan] * query.n_obs]
    with pytest.raises(OrcaInputError, match=r"obs\['score'\] of the AnnData holds continuous"):
        orca_sc.tl.annotate(single, labels_key="score", **FAST)


# ------------------------------------------------------------- 3, 4, 7: model files
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    ref, query = _split(n=400)
    model = orca_sc.OrcaModel.fit(query, ref, labels_key="cell_type", n_novel=2, **FAST)
    model.save(d / "model.pt")
    query.write_h5ad(d / "q.h5ad")
    assert len(model.head_names) > len(model.classes)  # has novel heads to tamper with
    return d


def _tampered(src, dst, change):
    import torch

    payload = torch.load(src, weights_only=True)
    change(payload)
    torch.save(payload, dst)
    return dst


def _nan_weight(p):
    p["state_dict"]["head.weight"][0, 0] = float("nan")


def _inf_centroid(p):
    p["centroids"][0, 0] = float("inf")


def _more_heads(p):
    p["meta"]["n_heads"] += 1


def _more_heads_and_names(p):
    p["meta"]["n_heads"] += 1
    p["meta"]["head_names"].append("novel_9")


def _int_head_names(p):
    m = p["meta"]
    m["head_names"] = m["classes"] + list(range(m["n_heads"] - len(m["classes"])))


def _int_classes(p):
    p["meta"]["classes"] = list(range(len(p["meta"]["classes"])))


def _no_genes(p):
    del p["meta"]["genes"]


def _bad_config(p):
    p["meta"]["config"]["lr"] = "fast"


TAMPERED = {
    _nan_weight: "weight 'head.weight' holds NaN or infinite values",
    _inf_centroid: "class centroids hold NaN or infinite values",
    _more_heads: "'head_names' must list the",
    _more_heads_and_names: "weight 'head.weight' has shape",
    _int_head_names: "head name 0 is neither a class nor a novel cluster",
    _int_classes: "'classes' must be a list of at least two unique cell-type names",
    _no_genes: "it has no 'genes'",
    _bad_config: "its configuration is invalid",
}


@pytest.mark.parametrize("change", list(TAMPERED), ids=lambda f: f.__name__.strip("_"))
def test_damaged_model_files_are_refused(change, trained, tmp_path):
    bad = _tampered(trained / "model.pt", tmp_path / "bad.pt", change)
    with pytest.raises(OrcaInputError, match=r"is damaged or was edited: .*Retrain it"):
        orca_sc.OrcaModel.load(bad)
    (tmp_path / "out").mkdir()
    r = _invoke(["predict", bad, trained / "q.h5ad", "-o", tmp_path / "out" / "p.h5ad"])
    assert_cli_error(r, TAMPERED[change])
    assert list((tmp_path / "out").iterdir()) == []


def test_model_paths_that_cannot_be_read(trained, tmp_path, monkeypatch):
    r = _invoke(["predict", tmp_path, trained / "q.h5ad", "-o", tmp_path / "p.h5ad"])
    assert_cli_error(r, "is a directory; pass the model file")
    import orca_sc._errors as errors_module

    def denied_to(suffix):
        def denied(path, *args, **kwargs):
            if str(path).endswith(suffix):
                raise PermissionError(13, "Permission denied", str(path))
            return open(path, *args, **kwargs)

        return denied

    monkeypatch.setattr(errors_module, "open", denied_to(".pt"), raising=False)
    r = _invoke(["predict", trained / "model.pt", trained / "q.h5ad", "-o", tmp_path / "p.h5ad"])
    assert_cli_error(r, "Cannot open model file", "Permission denied")
    monkeypatch.setattr(errors_module, "open", denied_to(".h5ad"), raising=False)
    r = _invoke(["predict", trained / "model.pt", trained / "q.h5ad", "-o", tmp_path / "p.h5ad"])
    assert_cli_error(r, "Cannot open query file", "Permission denied")
    assert not (tmp_path / "p.h5ad").exists()


# ------------------------------------------------- 4, 7, 8: the command line's own terms
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    ref, query = _split(n=400)
    ref.write_h5ad(d / "ref.h5ad")
    query.write_h5ad(d / "q.h5ad")
    return d


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--seed", "-1"], "Invalid --seed -1: expected an integer from 0"),
        (["--lr", "inf"], "Invalid --lr inf: expected a number in (0, 1]"),
        (["--lr", "1e30"], "Invalid --lr 1e+30"),
        (
            ["--epochs", "2", "--warmup-epochs", "5"],
            "Invalid --warmup-epochs 5: expected smaller than --epochs 2",
        ),
        (
            ["--n-novel", "1000000000"],
            "Invalid --n-novel 1000000000: expected at most 244 (the number of cells",
        ),
        (["--device", "cuda:3"], "Invalid --device cuda:3"),
        (["--batch-size", "1"], "Invalid --batch-size 1"),
        (["-o", ""], "Output file path is empty"),
        (["--save-model", ""], "Model file path is empty"),
        (["--report", " "], "Report file path is empty"),
    ],
)
def test_cli_errors_name_cli_options(extra, fragment, pair, tmp_path):
    args = ["annotate", pair / "ref.h5ad", pair / "q.h5ad", "--labels-key", "cell_type",
            "-o", tmp_path / "o.h5ad", "-q", "--n-genes", "0", *extra]  # fmt: skip
    before = sorted(p.name for p in pair.iterdir())
    r = _invoke(args)
    assert_cli_error(r, fragment)
    assert "=" not in r.stderr.split(":")[1]  # no Python field=value spelling
    assert list(tmp_path.iterdir()) == [] and sorted(p.name for p in pair.iterdir()) == before


def test_cli_short_run_shortens_the_warm_up(pair, tmp_path):
    r = _invoke(["annotate", pair / "ref.h5ad", pair / "q.h5ad", "--labels-key", "cell_type",
                 "-o", tmp_path / "o.h5ad", "--epochs", "2",
                 "--n-genes", "0", "-q"])  # fmt: skip
    assert r.exit_code == 0, r.output
    uns = ad.read_h5ad(tmp_path / "o.h5ad").uns["orca"]
    assert uns["params"]["epochs"] == 2 and uns["params"]["warmup_epochs"] == 1
