"""The ``orca-sc`` command line, in-process with click's CliRunner."""

import hashlib
import json
import os
import subprocess
import sys

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from click.testing import CliRunner
from conftest import FAST_ARGS, assert_cli_error

import orca_sc
from orca_sc.cli import main

SEEN = ["type_0", "type_1", "type_2"]


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(d):
    return sorted(p.name for p in d.iterdir())


def _split(seed=3):
    """Reference: labelled cells of 3 types; query: the rest, with 2 types the reference lacks."""
    a = orca_sc.datasets.simulate(600, 300, 5, markers_per_type=30, marker_fold=5.0, seed=seed)
    rng = np.random.default_rng(0)
    in_ref = a.obs["cell_type"].isin(SEEN).to_numpy() & (rng.random(a.n_obs) < 0.5)
    ref = a[in_ref].copy()
    query = a[~in_ref].copy()
    query.obs["truth"] = query.obs["cell_type"]
    del query.obs["cell_type"]
    return ref, query


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    ref, query = _split()
    ref.write_h5ad(d / "ref.h5ad")
    query.write_h5ad(d / "query.h5ad")
    return d


@pytest.fixture(scope="module")
def annotated(files):
    """One successful annotate run with every output; shared by the tests that read its files."""
    d = files / "run"
    d.mkdir()
    before = {n: _sha(files / n) for n in ("ref.h5ad", "query.h5ad")}
    args = ["annotate", str(files / "ref.h5ad"), str(files / "query.h5ad"), "--labels-key",
            "cell_type", "-o", str(d / "out.h5ad"), "--save-model", str(d / "model.pt"),
            "--truth-key", "truth", "--report", str(d / "report.json"), "--self-check",
            *FAST_ARGS]  # fmt: skip
    result = CliRunner().invoke(main, args)
    after = {n: _sha(files / n) for n in ("ref.h5ad", "query.h5ad")}
    return {"dir": d, "result": result, "before": before, "after": after}


def _invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_bad_input(result, *fragments, outdir=None, before=None):
    """Exit code 2, exactly one ``Error:`` line on stderr naming the problem, nothing written."""
    assert_cli_error(result, *fragments)
    assert result.stdout == ""
    if outdir is not None:
        assert _files(outdir) == before


# ------------------------------------------------------------------------------- success paths
def test_annotate_writes_annotated_query_model_and_report(annotated, files):
    r = annotated["result"]
    assert r.exit_code == 0, r.output
    d = annotated["dir"]
    assert _files(d) == ["model.pt", "out.h5ad", "report.json"]  # no temporary files left
    assert annotated["before"] == annotated["after"]  # inputs never modified
    out = ad.read_h5ad(d / "out.h5ad")
    query = ad.read_h5ad(files / "query.h5ad")
    assert (out.obs_names == query.obs_names).all()
    assert out.obs["orca_label"].notna().all()
    assert out.uns["orca"]["mode"] == "reference"
    rep = orca_sc.metrics.report(out, "truth")
    assert rep["seen_accuracy"] >= 0.9 and rep["novel_accuracy"] >= 0.8
    # stdout: counts per label, novel clusters with markers and closest types, metrics
    so = r.stdout
    assert "Cells per predicted label:" in so
    for label, n in out.obs["orca_label"].value_counts().items():
        assert any(line.split()[:2] == [label, str(n)] for line in so.splitlines())
    summary = orca_sc.tl.summarize(out)
    first = summary["novel"][0]  # each novel cluster in a line: size, closest types, markers
    assert any(
        line.split()[:3] == [first["name"], f"{first['size']:,}", "cells"]
        and f"{first['closest'][0]['type']} " in line
        and ", ".join(first["markers"]) in line
        for line in so.splitlines()
    )
    assert f"seen accuracy    {rep['seen_accuracy']:.3f}" in so
    # --self-check: one of the three reference types hidden, reported on stdout and in the JSON
    check = out.uns["orca"]["self_check"]
    assert len(check["hidden_types"]) == 1 and check["hidden_types"][0] in SEEN
    assert f"Self-check (hidden reference types: {check['hidden_types'][0]})" in so
    # the report holds the same numbers
    js = json.loads((d / "report.json").read_text())
    assert js["metrics"]["novel_accuracy"] == pytest.approx(rep["novel_accuracy"])
    assert js["summary"]["label_counts"] == {
        str(k): int(v) for k, v in out.obs["orca_label"].value_counts().items()
    }
    assert js["summary"]["self_check"]["novel_called"] == pytest.approx(check["novel_called"])
    nov = {rec["name"]: rec for rec in js["summary"]["novel"]}
    assert set(nov) == set(out.uns["orca"]["novel_cluster_sizes"])
    for rec in nov.values():
        assert len(rec["markers"]) == 5 and len(rec["closest"]) == 2
        assert rec["closest"][0]["similarity"] >= rec["closest"][1]["similarity"]


def test_novel_markers_are_the_simulated_marker_genes(annotated):
    """A novel cluster's top markers are the marker programme of the true type it captured."""
    d = annotated["dir"]
    out = ad.read_h5ad(d / "out.h5ad")
    js = json.loads((d / "report.json").read_text())
    for rec in js["summary"]["novel"]:
        cells = out.obs["orca_label"] == rec["name"]
        true_type = out.obs.loc[cells, "truth"].value_counts().idxmax()
        logm = np.log(out.varm["type_means"])  # (genes, types) true mean profiles
        t = int(true_type.split("_")[1])
        up = logm[:, t] - np.delete(logm, t, axis=1).max(axis=1)  # above every other type
        programme = set(out.var_names[np.argsort(-up)[:30]])
        assert len(set(rec["markers"]) & programme) >= 4, (rec, true_type)


def test_save_predict_round_trip_gives_annotate_labels(annotated, files):
    d = annotated["dir"]
    out_pred = d.parent / "pred.h5ad"
    r = _invoke(["predict", d / "model.pt", files / "query.h5ad", "-o", out_pred, "-q"])
    assert r.exit_code == 0, r.output
    a = ad.read_h5ad(d / "out.h5ad")
    p = ad.read_h5ad(out_pred)
    np.testing.assert_array_equal(p.obs["orca_label"].astype(str), a.obs["orca_label"].astype(str))
    assert p.uns["orca"]["mode"] == "predict"
    # a prediction trains nothing: its record says which sections it did not make
    rec = orca_sc.tl.RunRecord.from_uns(p.uns["orca"])
    assert rec.training is None and rec.novelty_test is None and rec.model_version is not None
    assert {"training", "history", "estimate"} <= set(p.uns["orca"]["not_made"])
    assert "queries" not in p.uns["orca"]["not_made"]
    assert "Cells per predicted label:" in r.stdout
    out_pred.unlink()


def test_predict_reports_missing_genes(annotated, files, tmp_path):
    q = ad.read_h5ad(files / "query.h5ad")
    q[:, 20:].copy().write_h5ad(tmp_path / "fewer.h5ad")  # 20 of 300 genes missing
    r = _invoke(["predict", annotated["dir"] / "model.pt", tmp_path / "fewer.h5ad"])
    assert r.exit_code == 0, r.output
    assert "20 of the model's 300 genes are missing" in r.stderr
    assert (tmp_path / "fewer.orca.h5ad").exists()  # default name beside the query
    q[:, 200:].copy().write_h5ad(tmp_path / "few.h5ad")
    before = _files(tmp_path)
    r = _invoke(["predict", annotated["dir"] / "model.pt", tmp_path / "few.h5ad"])
    assert_bad_input(r, "Only 100 of the model's 300 genes", outdir=tmp_path, before=before)


def test_default_output_beside_query_and_single_cell_class_warning(files, tmp_path):
    ref = ad.read_h5ad(files / "ref.h5ad")
    ref.obs["cell_type"] = ref.obs["cell_type"].astype(str)
    ref.obs.iloc[0, ref.obs.columns.get_loc("cell_type")] = "lonely"
    ref.write_h5ad(tmp_path / "ref.h5ad")
    (tmp_path / "q.h5ad").write_bytes((files / "query.h5ad").read_bytes())
    r = _invoke(["annotate", tmp_path / "ref.h5ad", tmp_path / "q.h5ad", "--labels-key",
                 "cell_type", *FAST_ARGS])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "Warning: 1 labelled class(es) have a single cell (['lonely'])" in r.stderr
    assert (tmp_path / "q.orca.h5ad").exists()
    # a second run does not overwrite without --overwrite ...
    before = _sha(tmp_path / "q.orca.h5ad")
    r = _invoke(["annotate", tmp_path / "ref.h5ad", tmp_path / "q.h5ad", "--labels-key",
                 "cell_type", *FAST_ARGS])  # fmt: skip
    assert_bad_input(r, "already exists; pass --overwrite")
    assert _sha(tmp_path / "q.orca.h5ad") == before


def test_progress_and_logs_go_to_stderr(files, tmp_path):
    """Once each, also where a library configured the root logger (CellTypist does)."""
    import io
    import logging

    root_stream = io.StringIO()
    root_handler = logging.StreamHandler(root_stream)
    logging.getLogger().addHandler(root_handler)
    try:
        r = _invoke(
            [
                "annotate",
                files / "ref.h5ad",
                files / "query.h5ad",
                "--labels-key",
                "cell_type",
                "-o",
                tmp_path / "o.h5ad",
                *FAST_ARGS[:-1],
            ]
        )  # fmt: skip  (not quiet)
    finally:
        logging.getLogger().removeHandler(root_handler)
    assert r.exit_code == 0, r.output
    assert "ORCA" in r.stderr and r.stderr.count("Novel heads:") == 1  # progress bar and log
    assert "ORCA:" not in r.stdout and "Novel heads" not in r.stdout
    assert "Novel heads" not in root_stream.getvalue()


def test_demo_end_to_end(tmp_path):
    r = _invoke(["demo", "--outdir", tmp_path / "demo", "-q"])
    assert r.exit_code == 0, r.output
    assert _files(tmp_path / "demo") == ["pbmc68k_orca.h5ad", "pbmc68k_orca_umap.png"]
    a = ad.read_h5ad(tmp_path / "demo" / "pbmc68k_orca.h5ad")
    rep = orca_sc.metrics.report(a, "bulk_labels")
    assert f"novel accuracy   {rep['novel_accuracy']:.3f}" in r.stdout
    assert rep["novel_accuracy"] >= 0.6 and rep["all_accuracy"] >= 0.6
    assert (tmp_path / "demo" / "pbmc68k_orca_umap.png").read_bytes()[:4] == b"\x89PNG"
    # what it found first, the evidence below it: the notes' lines there, not in the log
    out = r.stdout
    assert (
        out.index("Novel clusters")
        < out.index("Cells per predicted label")
        < out.index("Metrics")
        < out.index("Evidence")
    )
    lines = [n.line for n in orca_sc.tl.RunRecord.from_uns(a.uns["orca"]).notes]
    evidence = out[out.index("Evidence") :].splitlines()
    assert lines and all(f"  {x}" in evidence for x in lines)
    assert not any(x in r.stderr for x in lines)


def test_notes_are_one_line_each_in_the_log(annotated):
    """The log (stderr) shows each note of the run as one line, never its paragraph."""
    r = annotated["result"]
    a = ad.read_h5ad(annotated["dir"] / "out.h5ad")
    notes = orca_sc.tl.RunRecord.from_uns(a.uns["orca"]).notes
    assert notes
    err = r.stderr.splitlines()
    assert all(n.line in err for n in notes)
    assert not any(str(n) in r.stderr for n in notes)


def test_version_and_help():
    r = _invoke(["--version"])
    assert r.exit_code == 0 and orca_sc.__version__ in r.stdout
    for cmd in ("annotate", "predict", "demo"):
        r = _invoke([cmd, "--help"])
        assert r.exit_code == 0 and "Example" in r.stdout


def test_import_and_help_do_not_load_the_heavy_stack():
    """``import orca_sc`` and ``orca-sc --help`` stay light (PEP 562 lazy names); the public names
    still resolve on first use. Run in a fresh interpreter: this one has torch loaded already.
    """
    code = (
        "import sys, orca_sc\n"
        "from orca_sc.cli import main\n"
        "heavy = {'torch', 'scanpy', 'sklearn', 'anndata'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "from orca_sc import OrcaModel, OrcaConfig, TrainingDivergedError\n"
        "assert 'torch' in sys.modules\n"
        "assert orca_sc.tl.annotate and orca_sc.metrics.report and 'tl' in dir(orca_sc)\n"
        "assert all(getattr(orca_sc, n) is not None for n in orca_sc.__all__)\n"
        "from orca_sc._errors import TrainingDivergedError as T\n"
        "assert T is TrainingDivergedError\n"
        "try:\n"
        "    orca_sc.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "orca_sc", "--help"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0 and "annotate" in r.stdout
    loaded = {line.split("|")[-1].strip() for line in r.stderr.splitlines()}
    assert not {"torch", "scanpy", "sklearn", "anndata"} & loaded


# --------------------------------------------------------------------------------- bad inputs
def _write(tmp_path, name, adata):
    adata.write_h5ad(tmp_path / name)
    return tmp_path / name


def _annotate_args(ref, query, tmp_path, *extra):
    return ["annotate", ref, query, "--labels-key", "cell_type", "-o", tmp_path / "out" / "o.h5ad",
            *FAST_ARGS, *extra]  # fmt: skip


def _bad_ref(kind):
    ref, query = _split()
    if kind == "one_class":
        ref = ref[ref.obs["cell_type"] == "type_0"].copy()
    elif kind == "no_shared":
        query.var_names = [f"OTHER{i}" for i in range(query.n_vars)]
    elif kind == "duplicates":
        names = ref.var_names.tolist()
        names[5] = names[4]
        ref.var_names = names
    elif kind in ("nan", "inf", "negative"):
        X = query.X.toarray()
        X[3, 7] = {"nan": np.nan, "inf": np.inf, "negative": -1.0}[kind]
        query.X = sp.csr_matrix(X)
    elif kind == "empty_query":
        query = query[:0].copy()
    elif kind == "empty_ref":
        ref = ref[:0].copy()
    elif kind == "all_unlabelled_ref":
        ref.obs["cell_type"] = "Unknown"
    return ref, query


BAD_DATA = {
    "one_class": ("has 1 labelled class(es)", "at least 2 known cell types"),
    "no_shared": ("genes are shared", "OTHER"),
    "duplicates": ("duplicate gene names", "var_names_make_unique"),
    "nan": ("NaN or infinite",),
    "inf": ("NaN or infinite",),
    "negative": ("negative values",),
    "empty_query": ("The query has no cells",),
    "empty_ref": ("The reference has no cells",),
    "all_unlabelled_ref": ("no labelled cells",),
}


@pytest.mark.parametrize("kind", list(BAD_DATA))
def test_bad_data_is_one_clear_error(kind, tmp_path):
    ref, query = _bad_ref(kind)
    r_path, q_path = _write(tmp_path, "r.h5ad", ref), _write(tmp_path, "q.h5ad", query)
    (tmp_path / "out").mkdir()
    sums = (_sha(r_path), _sha(q_path))
    r = _invoke(_annotate_args(r_path, q_path, tmp_path))
    assert_bad_input(r, *BAD_DATA[kind], outdir=tmp_path / "out", before=[])
    assert (_sha(r_path), _sha(q_path)) == sums


def test_bad_files_and_keys(files, tmp_path):
    (tmp_path / "out").mkdir()
    ref, query = files / "ref.h5ad", files / "query.h5ad"

    def check(args, *fragments):
        assert_bad_input(_invoke(args), *fragments, outdir=tmp_path / "out", before=[])

    check(_annotate_args(tmp_path / "nope.h5ad", query, tmp_path), "does not exist")
    text = tmp_path / "notes.h5ad"
    text.write_text("cell_type\nB cell\n")
    check(_annotate_args(ref, text, tmp_path), "Cannot read Query file", "not an AnnData")
    trunc = tmp_path / "trunc.h5ad"
    data = query.read_bytes()
    trunc.write_bytes(data[: len(data) // 2])
    check(_annotate_args(trunc, query, tmp_path), "truncated/corrupt")
    check(
        ["annotate", ref, query, "--labels-key", "celltype", "-o", tmp_path / "out" / "o.h5ad"],
        "labels_key 'celltype' is not a column",
        "'cell_type'",
    )
    check(_annotate_args(ref, query, tmp_path, "--layer", "counts"), "Layer 'counts' not found")
    check(_annotate_args(ref, query, tmp_path, "--truth-key", "truth2"), "--truth-key 'truth2'")
    check(_annotate_args(ref, query, tmp_path, "--batch-key", "sample"), "batch_key 'sample'")
    for bad in ("-1", "two", "1.5"):
        check(
            _annotate_args(ref, query, tmp_path, "--n-novel", bad),
            f"--n-novel must be a non-negative integer or 'auto', got '{bad}'",
        )
    check(_annotate_args(ref, query, tmp_path, "--epochs", "0"), "Invalid --epochs 0")
    for bad in ("-5", "500"):
        check(
            _annotate_args(ref, query, tmp_path, "--discovery-cells", bad),
            f"--discovery-cells must be 0 (every cell) or at least 1000 cells, got {bad}",
        )
    check(_annotate_args(ref, query, tmp_path, "--epochs", "x"), "'x' is not a valid integer")
    if not torch.cuda.is_available():
        check(_annotate_args(ref, query, tmp_path, "--device", "cuda"), "no CUDA GPU")
    # outputs: inputs are never targets; missing or unwritable directories
    check(_annotate_args(ref, query, tmp_path, "-o", query, "--overwrite"), "is one of the input")
    check(_annotate_args(ref, query, tmp_path, "-o", tmp_path / "no" / "o.h5ad"), "does not exist")
    same = tmp_path / "out" / "o.h5ad"
    check(_annotate_args(ref, query, tmp_path, "--report", same), "are the same file")
    check(_annotate_args(ref, query, tmp_path, "--save-model", tmp_path / "out"), "is a directory")


def test_unwritable_output_directory(files, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        "orca_sc._cli_common.os.access",
        lambda p, mode: False if str(p) == str(locked) else real_access(p, mode),
    )
    r = _invoke(_annotate_args(files / "ref.h5ad", files / "query.h5ad", tmp_path, "-o",
                               locked / "o.h5ad"))  # fmt: skip
    assert_bad_input(r, "is not writable", outdir=locked, before=[])


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores permissions")
def test_unwritable_output_directory_for_real(files, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    r = _invoke(_annotate_args(files / "ref.h5ad", files / "query.h5ad", tmp_path, "-o",
                               locked / "o.h5ad"))  # fmt: skip
    assert_bad_input(r, "is not writable", outdir=locked, before=[])


def test_bad_model_files_are_refused(files, tmp_path):
    (tmp_path / "out").mkdir()

    def check(model, *fragments):
        r = _invoke(["predict", model, files / "query.h5ad", "-o", tmp_path / "out" / "p.h5ad"])
        assert_bad_input(r, *fragments, outdir=tmp_path / "out", before=[])

    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x80\x04garbage")
    check(corrupt, "not an orca_sc model or it is corrupt")
    marker = tmp_path / "code_ran"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    evil = tmp_path / "evil.pt"
    torch.save({"meta": Evil()}, evil)
    check(evil, "carry code are refused")
    assert not marker.exists()  # the pickle's code was never executed
    old = tmp_path / "old.pt"
    torch.save({"meta": {"format": "orca_sc.model/0"}, "state_dict": {}}, old)
    check(old, "has format 'orca_sc.model/0'", "incompatible orca_sc version")
    check(tmp_path / "missing.pt", "does not exist")


def test_interrupt_leaves_no_partial_output(files, tmp_path, monkeypatch):
    """Ctrl-C while the output is being written: no partial file, an old output stays intact."""
    out = tmp_path / "o.h5ad"
    out.write_bytes(b"previous result")

    def interrupted_write(self, path, *args, **kwargs):
        with open(path, "wb") as fh:
            fh.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(ad.AnnData, "write_h5ad", interrupted_write)
    r = _invoke(["annotate", files / "ref.h5ad", files / "query.h5ad", "--labels-key",
                 "cell_type", "-o", out, "--report", tmp_path / "r.json", "--overwrite",
                 *FAST_ARGS])  # fmt: skip
    assert r.exit_code == 130
    assert "Interrupted; no output was written." in r.stderr
    assert _files(tmp_path) == ["o.h5ad"] and out.read_bytes() == b"previous result"


# --------------------------------------------------------------------------- the error policy
@pytest.mark.parametrize("error", [ValueError("boom"), KeyError("boom"), RuntimeError("boom")])
def test_a_bug_is_an_internal_error_not_bad_input(files, tmp_path, monkeypatch, error):
    """An exception that is not ``OrcaInputError`` is our bug: exit 1, one line saying so and
    how to get the traceback, nothing written; ``--debug`` re-raises it with its traceback.
    """

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr("orca_sc._model.train", broken)
    args = ["annotate", files / "ref.h5ad", files / "query.h5ad", "--labels-key", "cell_type",
            "-o", tmp_path / "o.h5ad", "--save-model", tmp_path / "m.pt", *FAST_ARGS]  # fmt: skip
    r = _invoke(args)
    assert r.exit_code == 1, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: internal error"), r.stderr
    assert f"{type(error).__name__}: " in lines[0] and "boom" in lines[0]
    assert "bug in orca_sc" in lines[0] and "orca-sc --debug" in lines[0]
    assert "Traceback" not in r.output and _files(tmp_path) == []
    r = CliRunner().invoke(main, ["--debug", *map(str, args)])
    assert r.exit_code == 1 and r.exception is error


def test_a_failure_after_training_leaves_no_model_file(files, tmp_path, monkeypatch):
    """The model is staged beside its target and committed with the other outputs: a failure
    after training (here while summarising) leaves neither the model nor a temporary file.
    """

    def broken(*args, **kwargs):
        raise RuntimeError("summary failed")

    monkeypatch.setattr("orca_sc.tl.summarize", broken)
    r = _invoke(["annotate", files / "ref.h5ad", files / "query.h5ad", "--labels-key",
                 "cell_type", "-o", tmp_path / "o.h5ad", "--save-model", tmp_path / "m.pt",
                 *FAST_ARGS])  # fmt: skip
    assert r.exit_code == 1 and "summary failed" in r.stderr
    assert _files(tmp_path) == []


def test_training_divergence_is_a_failed_run_with_its_message(files, tmp_path, monkeypatch):
    from orca_sc._errors import TrainingDivergedError

    def diverged(*args, **kwargs):
        raise TrainingDivergedError("The training loss became nan in epoch 2; lower the lr.")

    monkeypatch.setattr("orca_sc._model.train", diverged)
    r = _invoke(["annotate", files / "ref.h5ad", files / "query.h5ad", "--labels-key",
                 "cell_type", "-o", tmp_path / "o.h5ad", *FAST_ARGS])  # fmt: skip
    assert r.exit_code == 1
    assert r.stderr.strip() == "Error: The training loss became nan in epoch 2; lower the lr."
