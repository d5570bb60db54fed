"""The benchmark suite: splits, baselines, scoring, memory measurement and the quick CLI run."""

import time

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from click.testing import CliRunner
from conftest import SHARED_DATA, assert_cli_error

import orca_sc
from orca_sc import OrcaInputError
from orca_sc import benchmark as B
from orca_sc.benchmark._splits import TRUTH
from orca_sc.cli import main

SHARED = SHARED_DATA


@pytest.fixture(scope="module")
def sim():
    a = orca_sc.datasets.simulate(
        800, 300, 6, markers_per_type=30, marker_fold=5.0, n_batches=2, seed=1
    )
    a.obs["batch"] = a.obs["batch"].astype(str)
    return a


def test_protocol_split(sim):
    t = B.protocol_split(sim, "cell_type", seen_fraction=0.5, labeled_fraction=0.5, seed=3)
    assert len(t.seen) == 3 and t.single
    # reference: only seen classes, about half of each; query: everything else
    assert set(t.reference.obs["cell_type"].astype(str)) == set(t.seen)
    assert t.reference.n_obs + t.query.n_obs == sim.n_obs
    n_seen_cells = sim.obs["cell_type"].isin(t.seen).sum()
    assert 0.4 < t.reference.n_obs / n_seen_cells < 0.6
    assert len(t.novel) == 3 and set(t.novel).isdisjoint(t.seen)
    assert t.query.obs["cell_type"].isna().all()  # labels hidden from the query
    # seeds draw different seen classes; explicit classes are honoured
    draws = {tuple(B.protocol_split(sim, "cell_type", seed=s).seen) for s in range(6)}
    assert len(draws) > 1
    t2 = B.protocol_split(sim, "cell_type", seen_classes=["type_0", "type_5"])
    assert t2.seen == ["type_0", "type_5"]
    with pytest.raises(OrcaInputError, match=r"seen classes \['nope'\] are not in"):
        B.protocol_split(sim, "cell_type", seen_classes=["nope"])
    with pytest.raises(OrcaInputError, match="labeled_fraction must be in"):
        B.protocol_split(sim, "cell_type", labeled_fraction=1.5)


def test_batch_split(sim):
    t = B.batch_split(sim, "cell_type", "batch", ["batch_0"], novel_classes=["type_1"])
    assert (t.reference.obs["batch"] == "batch_0").all()
    assert (t.query.obs["batch"] != "batch_0").all()
    assert "type_1" not in t.seen and "type_1" in t.novel
    assert not t.single
    with pytest.raises(OrcaInputError, match=r"reference batches \['x'\] are not in"):
        B.batch_split(sim, "cell_type", "batch", ["x"])
    with pytest.raises(OrcaInputError, match="leave at least one for the query"):
        B.batch_split(sim, "cell_type", "batch", ["batch_0", "batch_1"])


def test_score_names_clusters_by_oracle_only_when_asked():
    truth = np.array(["A"] * 4 + ["B"] * 4 + ["N"] * 4)
    clusters = np.array(["c1"] * 4 + ["c2"] * 4 + ["c3"] * 4)
    named = B.score(truth, clusters, ["A", "B"], names_types=False)
    assert named["seen_acc"] == 1.0 and named["novel_acc"] == 1.0 and named["novel_found"] == 1
    unnamed = B.score(truth, clusters, ["A", "B"], names_types=True)
    assert unnamed["seen_acc"] == 0.0 and unnamed["all_acc"] == 1.0


def test_lr_baseline_rejects_the_oracle_fraction(sim):
    t = B.protocol_split(sim, "cell_type", seed=0)
    pred = B.METHODS["LR + oracle reject + KMeans"].run(t, 0)
    rejected = ~np.isin(pred, t.seen)
    assert rejected.sum() == round(t.novel_fraction * t.query.n_obs)
    assert len(set(pred[rejected])) == len(t.novel)  # KMeans with the true number of types
    s = B.score(t.truth, pred, t.seen, True)
    assert s["seen_acc"] > 0.9 and s["novel_acc"] > 0.8  # well-separated simulated types


def test_supervised_reference_predicts_each_cell_from_a_fold_that_did_not_see_it(sim):
    t = B.batch_split(sim, "cell_type", "batch", ["batch_0"], novel_classes=["type_4", "type_5"])
    from orca_sc.benchmark._methods import CEILING_CLASSIFIERS, ceiling_predictions

    ref = B.METHODS["Supervised reference (query labels, CV)"]
    pred, info = ref.run(t, 0)
    truth = t.truth
    # the ceiling is the best of its classifiers on the task
    each = ceiling_predictions(t, 0)
    right = {n: float(np.mean(each[n] == truth)) for n in CEILING_CLASSIFIERS}
    assert right[info["reference"]] == max(right.values())
    novel = np.isin(truth, t.novel)
    # novel types are named after the truth it was trained on, known ones as the reference's
    assert set(pred[novel]) <= {f"novel:{c}" for c in t.novel}
    s = B.score(truth, pred, t.seen, ref.names_types)
    assert s["all_acc"] > 0.9 and s["novel_found"] == 2  # well-separated simulated types
    # a class held by one cell only is never predicted for it: its fold did not train on it
    obs = t.query.obs
    obs[TRUTH] = obs[TRUTH].astype(str)
    obs.iloc[0, obs.columns.get_loc(TRUTH)] = "only_here"
    assert "novel:only_here" not in set(ref.run(t, 0)[0])
    # in a grown task the draws of one cell share a fold: none of them trains the others' net
    g = B.grow_task(t, 3 * (t.reference.n_obs + t.query.n_obs), seed=0)
    obs = g.query.obs
    first = [f"{t.query.obs_names[0]}-{k}" for k in range(3)]
    obs.loc[first, TRUTH] = "only_here"
    assert "novel:only_here" not in set(ref.run(g, 0)[0])
    # grown with pooled pairs: no draw holding a test cell's counts trains, and a test draw
    # pooled with a training cell takes its own cell's first draw's prediction
    from orca_sc.benchmark._methods import _grown_sources

    m = B.grow_task(t, 3 * (t.reference.n_obs + t.query.n_obs), seed=0, mode="mix")
    source, partner = _grown_sources(m)
    n = t.query.n_obs
    np.testing.assert_array_equal(source, np.tile(np.arange(n), 3))
    assert (partner[:n] == -1).all() and (partner[n:] >= 0).all()
    types = np.asarray(t.truth, dtype=object)
    assert (types[partner[n:]] == types[source[n:]]).all()  # pooled within the type
    from orca_sc.benchmark._methods import ceiling_folds

    predicted = np.zeros(source.size, dtype=int)
    for train, test, pooled in ceiling_folds(source, partner, 5, 0):
        held = np.unique(source[test])
        assert not np.isin(source[train], held).any()  # no draw of a test cell trains ...
        assert not np.isin(partner[train], held).any()  # ... nor one pooled with it
        assert (pooled == test & np.isin(partner, source[train])).all()
        predicted += test
    assert (predicted == 1).all()
    assert len(ref.run(m, 0)[0]) == m.query.n_obs


def test_knn_transfer_and_clustering_baselines(sim):
    t = B.batch_split(sim, "cell_type", "batch", ["batch_0"], novel_classes=["type_4", "type_5"])
    s = B.score(t.truth, B.METHODS["kNN transfer (ingest-like) + Leiden"].run(t, 0), t.seen, True)
    assert s["seen_acc"] > 0.9
    km = B.METHODS["KMeans on query (NCD stand-in)"]
    assert not km.names_types
    s = B.score(t.truth, km.run(t, 0), t.seen, km.names_types)
    assert s["all_acc"] > 0.9


def test_peak_memory_sees_a_large_allocation():
    with B.PeakMemory() as mem:
        x = np.ones((200, 2**17))  # 200 MiB, touched
        x.sum()
        # held for a while, as in a real workload: the sampler thread needs the GIL to look
        time.sleep(0.1)
        del x
    assert 150 < mem.peak_mb < 400


def test_report_flags_baselines_that_beat_orca():
    runs = pd.DataFrame(
        [
            {"task": "t", "method": m, "family": f, "seed": 0, "novel_true": 2, "seen_acc": s,
             "novel_acc": n, "novel_nmi": n, "all_acc": s, "novel_found": 2, "seconds": 1.0,
             "peak_mb": 1.0, "error": ""}
            for m, f, s, n in [("ORCA", "ORCA", 0.9, 0.7), ("ORCA-FNM", "ablation", 0.9, 0.8),
                               ("KMeans on query (NCD stand-in)", "baseline", 0.5, 0.75)]
        ]
    )  # fmt: skip
    res = B.BenchmarkResult(runs, B.summarize_runs(runs), settings={"methods": ["ORCA"]})
    md = B.markdown(res)
    assert "t: ORCA-FNM novel accuracy 0.800 ≥ ORCA 0.700 (seeds [0])" in md
    assert "t: KMeans on query (NCD stand-in) beats ORCA on novel (0.750 vs 0.700)" in md
    assert "| ORCA | 0.900 | 0.700 | 0.700 | 0.900 | 2.0 (2) |" in md


def test_quick_benchmark_cli(tmp_path):
    out = tmp_path / "bench"
    r = CliRunner().invoke(main, ["benchmark", "--quick", "--outdir", str(out), "-q"])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in out.iterdir())
    assert names == ["bars.png", "report.md", "runs.csv", "scaling.csv", "scaling.png",
                     "settings.json", "summary.csv"]  # fmt: skip
    runs = pd.read_csv(out / "runs.csv")
    assert set(runs["method"]) == set(B.QUICK_METHODS)
    assert (runs["task"] == "pbmc68k_protocol").all() and (runs["seed"] == 0).all()
    for m in ("seen_acc", "novel_acc", "novel_nmi", "all_acc"):
        assert runs[m].between(0, 1).all()
    orca = runs.set_index("method").loc["ORCA"]
    assert orca["novel_acc"] > 0.5  # real data: the hidden PBMC types are found
    sc = pd.read_csv(out / "scaling.csv")
    o = sc[sc["method"] == "ORCA"]
    assert list(o["n_cells"]) == [500, 1000]
    # figures, not checks of speed (a floor from a 20-repeat matmul is noisy at these sizes)
    assert (o["flop_floor_seconds_per_epoch"] > 0).all() and (o["seconds_per_epoch"] > 0).all()
    assert "## pbmc68k_protocol" in r.stdout and "| ORCA |" in r.stdout
    # a second run refuses to overwrite the report
    r2 = CliRunner().invoke(main, ["benchmark", "--quick", "--outdir", str(out), "-q"])
    assert r2.exit_code == 2 and "already holds a report" in r2.stderr


def test_benchmark_cli_bad_options(tmp_path):
    def err(*args):
        r = CliRunner().invoke(main, ["benchmark", "--outdir", str(tmp_path / "b"), *args])
        assert r.exit_code == 2, r.output
        assert not (tmp_path / "b").exists()
        return r.stderr

    assert "unknown --method ['nope']" in err("--method", "nope")
    assert "unknown --task ['nope']" in err("--task", "nope")
    assert "--h5ad needs --labels-key" in err("--h5ad", str(tmp_path / "x.h5ad"))
    assert "comma-separated list of ints" in err("--seeds", "a,b")


def test_celltypist_baseline_is_seeded(sim):
    pytest.importorskip("celltypist")
    t = B.batch_split(sim, "cell_type", "batch", ["batch_0"], novel_classes=["type_4", "type_5"])
    run = B.METHODS["CellTypist + Leiden"].run
    np.testing.assert_array_equal(run(t, 0), run(t, 0))


def test_sim_tasks_of_the_development_suite():
    """Each sweep point builds the task it says: query size, novel types hidden from the
    reference, labelled fraction in the protocol design, every seen type in the reference.
    """
    settings = {s.name: s for s in B.sim_settings(large=False)}
    assert {"query150", "novel0", "novel20", "protocol_lab0.05", "speed_1k_1k"} <= set(settings)
    t = B.make_sim_task(settings["query150"], seed=0)
    assert 120 < t.query.n_obs < 180 and not t.single and len(t.novel) == 4
    assert set(t.reference.obs["cell_type"].astype(str)) == set(t.seen)
    assert set(t.novel) <= set(t.truth) and not set(t.novel) & set(t.seen)
    closed = B.make_sim_task(settings["novel0"], seed=1)
    assert closed.novel == [] and set(closed.truth) <= set(closed.seen)
    few = B.make_sim_task(settings["protocol_lab0.05"], seed=0)
    n_seen_cells = few.reference.n_obs + np.isin(few.truth, few.seen).sum()
    assert few.single and 0.03 < few.reference.n_obs / n_seen_cells < 0.07
    # seeds draw other data
    a0 = B.make_sim_task(settings["query150"], seed=0).query.X
    a1 = B.make_sim_task(settings["query150"], seed=1).query.X
    assert a0.shape != a1.shape or (a0 != a1).nnz > 0
    # nested: two of the novel types are subtypes of seen types (cross-batch and protocol)
    for name in ("nested2", "protocol_nested2"):
        t = B.make_sim_task(settings[name], seed=0)
        sub = t.reference.uns["simulation"]["subtype_of"]
        assert len(sub) == 2 and set(sub) <= set(t.novel) and set(sub.values()) <= set(t.seen)
    # a condition shift: three seen types carry the program in the query, none in the reference
    t = B.make_sim_task(settings["condition3"], seed=0)
    assert not t.reference.obs["condition"].any()
    responding = set(t.truth[t.query.obs["condition"].to_numpy()])
    assert len(responding) == 3 and responding <= set(t.seen) and len(t.novel) == 4
    assert B.make_sim_task(settings["condition3_novel0"], seed=0).novel == []
    assert {"typeshift0.2", "typeshift0.4", "typeshift0.8"} <= set(settings)
    # several queries: batches of their own sharing the known types and one novel type
    t = B.make_sim_task(settings["queries2_q180"], seed=0)
    q = t.query.obs["batch"].astype(str)
    assert t.info["query_key"] == "batch" and q.nunique() == 2 and len(t.novel) == 1
    for g in q.unique():
        truth = t.truth[(q == g).to_numpy()]
        assert set(truth) == set(t.seen) | set(t.novel) and 140 < truth.size < 220


def test_several_queries_are_annotated_together_and_come_back_in_the_query_order():
    setting = {s.name: s for s in B.sim_settings(large=False)}["queries2_q180"]
    task = B.make_sim_task(setting, seed=1)
    q, rows = B.annotate_task(task, 0, epochs=5, warmup_epochs=1, epoch_min_steps=30,
                              novelty_folds=0)  # fmt: skip
    assert list(q.obs_names[rows]) == list(task.query.obs_names)
    assert (q.obs["truth"].to_numpy() == task.truth).all()
    assert q.obs["orca_label"].notna().all()
    # one run for both queries: the record counts each query's labels
    counts = q.uns["orca"]["queries"]["label_counts"]
    assert list(counts.columns) == ["query_1", "query_2"]
    per_query = q.obs.groupby("batch", observed=True).size().to_numpy()
    assert (counts.sum(axis=0).to_numpy() == per_query).all()


def test_dev_suite_cli_reports_novel_calls(tmp_path):
    """The development suite from the command line, with a peer (ORCA's own figures are read
    from its run in :func:`orca_suite_run`).
    """
    out = tmp_path / "dev"
    r = CliRunner().invoke(
        main,
        ["benchmark", "--suite", "dev", "--quick", "--task", "sim_query150",
         "--method", "LR + oracle reject + KMeans", "--outdir", str(out), "-q"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert (out / "suite.md").is_file() and not (out / "scaling.csv").exists()
    runs = pd.read_csv(out / "runs.csv").set_index("method")
    for col in ("novel_called", "known_called_novel"):
        assert runs[col].between(0, 1).all()
    assert "novel_est" not in runs or runs["novel_est"].isna().all()  # ORCA's estimate alone
    md = (out / "suite.md").read_text()
    assert "| sim_query150 | LR + oracle reject + KMeans |" in md and "known->novel" in md
    assert md in r.stdout


def test_only_selects_a_task_by_its_exact_name_before_parts_of_names():
    """``--only sim_novel1`` runs that task, not also ``sim_novel10``; text that names no task
    exactly still selects every task whose name contains it.
    """
    names = lambda only: [s.name for s in B.dev_suite(None, only=only)]  # noqa: E731
    assert names(["sim_novel1"]) == ["sim_novel1"]
    assert {"sim_novel1", "sim_novel10", "sim_novel20"} <= set(names(["sim_novel"]))
    assert names(["sim_novel1", "scale5k"]) == ["sim_novel1", "sim_scale5k_sparse",
                                                 "sim_scale5k_dense"]  # fmt: skip
    assert names(["no_such_task"]) == []


def test_only_selects_the_tasks_of_a_dataset_family():
    """``--only family:real`` selects every task of a real dataset family (the families a
    default is judged on: not the simulations; a user's own task is real data, and the judge
    of ``orca-sc compare --ceiling`` counts it as its own family), ``family:TEXT`` the tasks of
    the families whose name holds the text; with names, the union.
    """
    from orca_sc.benchmark._suite import select_tasks
    from orca_sc.benchmark._tasks import TaskSpec

    names = ["sibling_worm", "worm_neuron_protocol", "tm_marrow_to_kidney", "pbmc_sorted_to_3k",
             "few5_baron", "sim_base", "sim_novel1", "my_h5ad"]  # fmt: skip
    specs = [TaskSpec(n, "cross-batch", lambda seed: None, "") for n in names]
    pick = lambda only: [s.name for s in select_tasks(specs, only)]  # noqa: E731
    assert pick(["family:real"]) == names[:5] + ["my_h5ad"]
    assert pick(["family:Worm"]) == ["sibling_worm", "worm_neuron_protocol"]
    assert pick(["family:simulated"]) == ["sim_base", "sim_novel1"]
    assert pick(["family:worm", "sim_base"]) == ["sibling_worm", "worm_neuron_protocol", "sim_base"]
    assert pick(["family:nothing"]) == []


def test_scale_task_changes_only_the_number_of_cells():
    """The scale task: the same simulated setting at every size (only the cells change), its
    large sizes in the large tier only, at two depths.
    """
    small = {s.name: s for s in B.scale_settings()}
    large = {s.name: s for s in B.scale_settings(large=True)}
    assert set(small) == {"scale5k_sparse", "scale20k_sparse", "scale5k_dense", "scale20k_dense"}
    assert set(large) - set(small) == {"scale50k_sparse", "scale100k_sparse", "scale50k_dense",
                                       "scale100k_dense"}  # fmt: skip
    a, b = large["scale5k_sparse"], large["scale100k_sparse"]
    differ = {f for f in a.__dataclass_fields__ if getattr(a, f) != getattr(b, f)}
    assert differ == {"name", "n_ref", "n_query"}
    assert b.n_ref / (b.n_ref + b.n_query) == a.n_ref / (a.n_ref + a.n_query) == 0.25
    t = B.make_sim_task(small["scale5k_sparse"], seed=0)
    assert 4500 < t.reference.n_obs + t.query.n_obs < 5500 and len(t.novel) == 10
    density = t.query.X.nnz / np.prod(t.query.shape)
    dense = B.make_sim_task(small["scale5k_dense"], seed=0).query
    assert 0.08 < density < 0.2 and 0.35 < dense.X.nnz / np.prod(dense.shape) < 0.55
    names = {s.name for s in B.dev_suite(None)}
    assert "sim_scale20k_dense" in names and "sim_scale100k_dense" not in names
    assert "sim_scale100k_dense" in {s.name for s in B.dev_suite(None, scale=True)}


def test_grow_task_redraws_every_cell_with_fresh_noise(sim):
    """Each cell drawn ``factor`` times by binomial thinning: counts keep about ``keep`` of the
    original, draws differ from each other, labels and truth follow their cell, and the source
    task is left as it was.
    """
    t = B.batch_split(sim, "cell_type", "batch", ["batch_0"], novel_classes=["type_5"])
    before = t.reference.X.copy()
    g = B.grow_task(t, 3 * (t.reference.n_obs + t.query.n_obs), keep=0.8, seed=0)
    n_ref = t.reference.n_obs
    assert g.reference.n_obs == 3 * n_ref and g.query.n_obs == 3 * t.query.n_obs
    assert (t.reference.X != before).nnz == 0  # the source is untouched
    X = g.reference.X
    total = X.sum(dtype=np.float64) / (3 * before.sum(dtype=np.float64))
    assert 0.78 < total < 0.82
    assert np.all(X.data == np.round(X.data)) and X.data.min() > 0
    draws = [X[k * n_ref : (k + 1) * n_ref] for k in range(3)]
    assert (draws[0] != draws[1]).nnz > 0
    # no draw has more of a gene than its cell had (so none of a gene it did not express)
    assert (draws[2] > before).nnz == 0
    labels = g.reference.obs["cell_type"].astype(str).to_numpy()
    np.testing.assert_array_equal(labels[2 * n_ref :], t.reference.obs["cell_type"].astype(str))
    np.testing.assert_array_equal(g.truth[: t.query.n_obs], t.truth)
    assert g.seen == t.seen and g.novel == t.novel and g.name.endswith("_x3")
    logged = t.reference.copy()
    logged.X = np.log1p(logged.X)
    with pytest.raises(OrcaInputError, match="raw counts"):
        B.grow_task(B.Task("x", logged, t.query, "cell_type", t.seen, False), 1000)


def test_grow_task_mix_draws_new_cells_of_each_type_at_the_same_depth(sim):
    """``mode="mix"``: the first draw is the cell thinned, later draws pool the cell with a cell
    of its own type and thin the sum by ``keep / 2`` (same depth, not a copy of one cell).
    """
    t = B.batch_split(sim, "cell_type", "batch", ["batch_0"], novel_classes=["type_5"])
    g = B.grow_task(t, 3 * (t.reference.n_obs + t.query.n_obs), keep=0.8, seed=0, mode="mix")
    assert g.name.endswith("_x3_mix") and g.info["grown"]["mode"] == "mix"
    n_ref, X0 = t.reference.n_obs, sp.csr_matrix(t.reference.X)
    X = sp.csr_matrix(g.reference.X)
    total = X.sum(dtype=np.float64) / (3 * X0.sum(dtype=np.float64))
    assert 0.77 < total < 0.83
    later = X[2 * n_ref :]
    # some later draws hold a gene their own cell did not express (pooled with another cell) ...
    assert (later > X0).nnz > 0
    # ... but never one that no cell of their type expressed
    types = t.reference.obs["cell_type"].astype(str).to_numpy()
    for ty in np.unique(types):
        m = types == ty
        seen_genes = np.asarray(X0[m].sum(axis=0)).ravel() > 0
        assert not np.asarray(later[m].sum(axis=0)).ravel()[~seen_genes].any()
    np.testing.assert_array_equal(g.truth[2 * t.query.n_obs :], t.truth)
    with pytest.raises(OrcaInputError, match="mode"):
        B.grow_task(t, 1000, mode="copy")
    # the large tier's grown tasks are drawn this way (copies make the kNN graph a union of cliques)
    from orca_sc.benchmark._suite import _grown

    assert _grown(lambda seed: t, 1000, 0).info["grown"]["mode"] == "mix"


# ------------------------------------------------------------------ the suite's hard corners
@pytest.fixture(scope="module")
def nested():
    """Six types; type_4 is a subtype of type_0 and type_5 of type_1 (their nearest types)."""
    a = orca_sc.datasets.simulate(
        1500, 400, 6, markers_per_type=30, marker_fold=5.0, n_batches=2,
        subtype_of={4: 0, 5: 1}, imbalance=2.0, seed=2,
    )  # fmt: skip
    a.obs["batch"] = a.obs["batch"].astype(str)
    return a


def test_sibling_types_are_the_nearest_to_a_known_type(nested):
    from orca_sc.benchmark._hard import class_similarity, sibling_types

    classes, sim = class_similarity(nested, "cell_type")
    assert sim.shape == (6, 6) and np.allclose(np.diag(sim), 1.0)
    # each subtype's nearest other type is its parent
    for child, parent in (("type_4", "type_0"), ("type_5", "type_1")):
        row = sim[classes.index(child)].copy()
        row[classes.index(child)] = -np.inf
        assert classes[int(np.argmax(row))] == parent
    assert sibling_types(nested, "cell_type") == ["type_4", "type_5"]


def test_sibling_split_in_a_separate_query(nested):
    from orca_sc.benchmark._hard import sibling_split

    by_batch = sibling_split(nested, "cell_type", batch_key="batch", reference_batch="batch_0")
    assert by_batch.novel == ["type_4", "type_5"] and not by_batch.single
    assert set(by_batch.reference.obs["batch"]) == {"batch_0"}
    assert set(by_batch.query.obs["batch"]) == {"batch_1"}
    assert set(by_batch.reference.obs["cell_type"].astype(str)).isdisjoint(by_batch.novel)
    halves = [sibling_split(nested, "cell_type", seed=s) for s in (0, 1)]
    for t in halves:  # without batches: a random half of the cells is the query
        assert 0.4 < t.query.n_obs / nested.n_obs < 0.6 and t.novel == ["type_4", "type_5"]
        assert set(t.reference.obs["cell_type"].astype(str)).isdisjoint(t.novel)
    assert not np.array_equal(halves[0].query.obs_names, halves[1].query.obs_names)


def test_few_labels_tiny_query_and_known_only(nested):
    from orca_sc.benchmark._hard import few_labels, known_only, sibling_split, tiny_query

    task = sibling_split(nested, "cell_type", batch_key="batch", reference_batch="batch_0")
    few = few_labels(task, 5, "few5")
    counts = few.reference.obs["cell_type"].value_counts()
    assert few.name == "few5" and set(counts.index) == set(task.seen) and counts.max() == 5
    assert few.query.n_obs == task.query.n_obs
    assert few_labels(task, 5, "few5").reference.obs_names.equals(few.reference.obs_names)
    tiny = tiny_query(task, 15, "tiny")
    per = pd.Series(tiny.truth).value_counts()
    assert per.max() == 15 and set(per.index) == set(task.truth)
    assert tiny.reference.n_obs == task.reference.n_obs
    none = known_only(task, "none")
    assert none.novel == [] and none.query.n_obs == np.isin(task.truth, task.seen).sum()
    with pytest.raises(OrcaInputError, match="separate-query task"):
        few_labels(B.protocol_split(nested, "cell_type", seed=0), 5, "x")


def test_suite_table_reports_seed_spread_and_the_worst_task():
    from orca_sc.benchmark._suite_table import suite_table, worst_tasks

    rows = []
    for task, called, known, found in (("a", (1.0, 0.8), (0.0, 0.1), (2, 2)),
                                       ("b", (0.95, 0.95), (0.02, 0.02), (2, 3))):  # fmt: skip
        for seed in (0, 1):
            rows.append({"task": task, "method": "ORCA", "seed": seed, "n_query": 100,
                         "seen_acc": 0.9, "novel_acc": 0.8, "all_acc": 0.85,
                         "novel_called": called[seed], "known_called_novel": known[seed],
                         "novel_found": found[seed], "novel_true": 2, "seconds": 1.0,
                         "error": ""})  # fmt: skip
    t = suite_table(pd.DataFrame(rows)).set_index("task")
    assert t.loc["a", "novel_called"] == pytest.approx(0.9)
    assert t.loc["a", "novel_called_sd"] == pytest.approx(0.1)
    assert t.loc["b", "novel_called_sd"] == 0 and t.loc["b", "found_exact"] == 0.5
    lines = "\n".join(worst_tasks(t.reset_index()))
    assert "novel_called: worst a 0.900; 2 of 2 tasks meet >= 0.9" in lines
    assert "known_called_novel: worst a 0.050; 2 of 2 tasks meet <= 0.05" in lines
    assert "found_exact: worst b 0.500; 1 of 2 tasks meet >= 0.7" in lines


def test_shortfalls_give_the_supervised_reference_as_the_reason():
    from orca_sc.benchmark._suite_table import REFERENCE, shortfalls, suite_table

    rows = []
    for method, task, called, known in (("ORCA", "a", 0.5, 0.2), ("ORCA", "b", 0.95, 0.01),
                                        ("ORCA", "c", 0.6, 0.0), (REFERENCE, "a", 0.95, 0.3)):  # fmt: skip
        rows.append({"task": task, "method": method, "seed": 0, "n_query": 100,
                     "seen_acc": 0.9, "novel_acc": 0.8, "all_acc": 0.85, "novel_called": called,
                     "known_called_novel": known, "novel_found": 2, "novel_true": 2,
                     "seconds": 1.0, "error": ""})  # fmt: skip
    lines = shortfalls(suite_table(pd.DataFrame(rows)))
    assert lines == [
        "- a: novel->novel 0.500; the supervised reference 0.950 meets the goal",
        "- a: known->novel 0.200; the supervised reference 0.300 misses it too",
        "- c: novel->novel 0.600",
    ]


def test_below_peers_names_the_best_peer_that_uses_no_truth():
    from orca_sc.benchmark._suite_table import below_peers, suite_table

    rows = []
    for method, task, acc in (("ORCA", "a", 0.80), ("ORCA", "b", 0.90),
                              ("CellTypist + Leiden", "a", 0.85),
                              ("kNN transfer (ingest-like) + Leiden", "a", 0.83),
                              ("LR + oracle reject + KMeans", "b", 0.99),
                              ("kNN transfer (ingest-like) + Leiden", "b", 0.91)):  # fmt: skip
        rows.append({"task": task, "method": method, "seed": 0, "n_query": 100,
                     "seen_acc": acc, "novel_acc": acc, "all_acc": acc, "novel_called": 0.9,
                     "known_called_novel": 0.0, "novel_found": 2, "novel_true": 2,
                     "seconds": 1.0, "error": ""})  # fmt: skip
    # b: 0.90 against kNN's 0.91 is within 2 points; the oracle-given LR is no peer here
    assert below_peers(suite_table(pd.DataFrame(rows))) == [
        "- a: all-class 0.800, CellTypist + Leiden 0.850"
    ]


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared data absent")
def test_the_dev_suite_holds_the_hard_corners_of_the_real_data():
    specs = {s.name: s for s in B.dev_suite(SHARED, large=False)}
    for name in ("sibling_baron", "sibling_mca", "sibling_pbmc68k", "few5_baron", "few25_mca",
                 "tiny_pbmc", "none_pbmc_dropseq_to_indrops", "none_baron"):  # fmt: skip
        assert name in specs, sorted(specs)
    t = specs["sibling_baron"].make(0)
    assert t.novel and set(t.novel).isdisjoint(t.seen)
    # the pair's other way: the same sibling types, mouse 2 the reference
    back = specs["sibling_baron_mouse2_to_mouse1"].make(0)
    assert back.novel == t.novel
    assert set(back.query.obs["batch"]) == {"mouse1"} and set(t.query.obs["batch"]) == {"mouse2"}
    none = specs["none_baron"].make(0)
    assert none.novel == [] and none.query.n_obs > 500
    tiny = specs["tiny_pbmc"].make(1)
    assert pd.Series(tiny.truth).value_counts().max() <= 15


def test_scaling_only_times_orca_with_defaults_against_celltypist(tmp_path):
    out = tmp_path / "scale"
    args = ["benchmark", "--scaling-only", "--scaling-sizes", "400", "--outdir", str(out), "-q"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["scaling.csv", "scaling.md", "scaling.png"]
    sc = pd.read_csv(out / "scaling.csv")
    o = sc[sc["method"] == "ORCA"].set_index("n_cells")
    assert list(o.index) == [400] and (o["storage"] == "memory").all()
    # a real run with the defaults: every phase ran within its schedule and says why it stopped
    for c in ("warmup", "open_world"):
        assert (o[f"{c}_steps"] <= o[f"{c}_max_steps"]).all()
        assert o[f"{c}_stopped"].isin(["converged", "schedule"]).all()
    assert (o["steps"] == o["warmup_steps"] + o["open_world_steps"]).all()
    assert (o["seconds"] > o["training_seconds"]).all() and o["all_accuracy"].between(0, 1).all()
    assert len(sc[sc["method"] != "ORCA"]) == 1  # CellTypist (or its model family) beside
    # seconds per stage beside the total: the outer stages and the rest add up to it
    from orca_sc.benchmark._scaling import STAGE_PREFIX

    stages = [c for c in o.columns if c.startswith(STAGE_PREFIX)]
    outer = [c for c in stages if c[len(STAGE_PREFIX) :] not in B.StageTimer.NESTED]
    for name in ("warm-up", "discovery", "open-world fit", "margin refresh", "other"):
        assert (o[STAGE_PREFIX + name] >= 0).all()
    np.testing.assert_allclose(o[outer].sum(axis=1), o["seconds"], rtol=1e-6)
    md = (out / "scaling.md").read_text()
    assert "× CellTypist" in md and "| ORCA | 400 |" in md and "| memory |" in md
    assert "ORCA's seconds per stage" in md and "| open-world fit |" in md
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "already holds a report" in again.stderr


def test_scaling_at_several_densities_compares_each_with_its_own_peer():
    sc = B.run_scaling((600,), n_genes=200, library_size=(150, 3000), progress=False)
    o = sc[sc["method"] == "ORCA"].set_index("library_size")
    assert list(o.index) == [150.0, 3000.0] and len(sc) == 4
    assert o.loc[150.0, "non_zeros"] < o.loc[3000.0, "non_zeros"]
    md = B._report._scaling_table(sc)
    peers = sc[sc["method"] != "ORCA"].set_index("library_size")["seconds"]
    for lib, r in o.iterrows():  # each ratio against the peer on the same data
        assert f"| {r['seconds'] / peers[lib]:.2f} |" in md
    assert md.count("| ORCA | 600 |") == 2
    stage_head = md.split("per stage")[1].splitlines()[2]  # one column per density
    assert stage_head.count("600 memory") == 2


def test_scaling_from_disk_writes_the_simulation_once(tmp_path):
    sc = B.run_scaling((), n_genes=300, disk_sizes=(800,), workdir=tmp_path, progress=False)
    files = list(tmp_path.glob("*.h5ad"))
    assert len(files) == 1 and not list(tmp_path.glob("*.partial*"))
    assert list(sc["storage"]) == ["disk"] and list(sc["method"]) == ["ORCA"]
    assert sc["steps"].iloc[0] > 0 and sc["all_accuracy"].iloc[0] > 0.5
    mtime = files[0].stat().st_mtime_ns
    # a second run finds the file and reads it (the same path), without writing it again
    from orca_sc.benchmark._scaling import _simulated_file

    assert _simulated_file(800, 300, 0, 150.0, tmp_path) == files[0]
    assert files[0].stat().st_mtime_ns == mtime


@pytest.fixture(scope="module")
def orca_suite_run(tmp_path_factory):
    """ORCA alone on one suite task with an override (the before/after run of a change)."""
    out = tmp_path_factory.mktemp("suite") / "orca"
    r = CliRunner().invoke(
        main,
        ["benchmark", "--suite", "dev", "--quick", "--only", "query150", "--method", "ORCA",
         "--seeds", "0", "--set", "novelty_folds=0", "--set", "anchor_weight=0.3",
         "--outdir", str(out), "-q"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def test_orca_alone_on_the_suite_carries_every_figure_and_its_overrides(orca_suite_run):
    runs = pd.read_csv(orca_suite_run / "runs.csv")
    assert list(runs["task"]) == ["sim_query150"] and list(runs["method"]) == ["ORCA"]
    for col in ("novel_called", "known_called_novel", "all_acc", "novel_found", "peak_mb",
                "warmup_steps", "open_world_stopped", "ev_supported_clusters", "threshold"):  # fmt: skip
        assert col in runs, col
    # novelty_folds=0 took effect: no novelty test, so no p-value figures and no cell anchored
    # for a significant one
    assert "known_p_below_alpha" not in runs and (runs["anchored_significant"] == 0).all()
    settings = (orca_suite_run / "settings.json").read_text()
    assert '"novelty_folds": 0' in settings and '"anchor_weight": 0.3' in settings
    assert runs["novel_est"].iloc[0] >= 0
    for col in ("novel_called", "known_called_novel"):
        assert runs[col].between(0, 1).all()
    md = (orca_suite_run / "suite.md").read_text()
    assert "| sim_query150 | ORCA |" in md and "## Number of novel types (ORCA, every run)" in md


def test_compare_makes_the_before_after_tables_and_the_drops_check(orca_suite_run, tmp_path):
    before = orca_suite_run / "runs.csv"
    r = CliRunner().invoke(main, ["compare", str(before), str(before), "--check"])
    assert r.exit_code == 0, r.output
    assert "Tasks failing the check: 0 of 1" in r.stdout and "| novel→novel ≥ 0.9 |" in r.stdout
    worse = pd.read_csv(before)
    worse["known_called_novel"] += 0.1
    worse["all_acc"] -= 0.05
    after = tmp_path / "after.csv"
    worse.to_csv(after, index=False)
    md = tmp_path / "cmp.md"
    r = CliRunner().invoke(main, ["compare", str(before), str(after), "--check", "--out", str(md)])
    assert r.exit_code == 1
    assert "| sim_query150 | known_called_novel |" in r.stdout
    assert "| sim_query150 | all_acc |" in r.stdout
    assert "Tasks failing the check: 1 of 1" in md.read_text()
    # without --check the tables are printed and the exit is clean
    assert CliRunner().invoke(main, ["compare", str(before), str(after)]).exit_code == 0
    # with the ceiling's rows: the families' section (a simulated task alone: no real family)
    ceiling = pd.read_csv(before).assign(method="Supervised reference (query labels, CV)")
    ceiling.to_csv(tmp_path / "ceiling.csv", index=False)
    r = CliRunner().invoke(main, ["compare", str(before), str(after), "--ceiling",
                                  str(tmp_path / "ceiling.csv")])  # fmt: skip
    assert r.exit_code == 0 and "## Per dataset family, on feasible tasks" in r.stdout


def test_compare_and_suite_options_refuse_bad_input(tmp_path, orca_suite_run):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    runs = str(orca_suite_run / "runs.csv")
    assert_cli_error(CliRunner().invoke(main, ["compare", str(bad), runs]), "lacks the columns")
    assert_cli_error(
        CliRunner().invoke(main, ["compare", str(tmp_path / "none.csv"), runs]), "cannot be read"
    )
    # the ORCA rows are no ceiling: --ceiling wants the supervised reference's
    assert_cli_error(
        CliRunner().invoke(main, ["compare", runs, runs, "--ceiling", runs]), "holds no rows of"
    )
    out = ["--outdir", str(tmp_path / "o")]
    for args, msg in [
        (["--set", "novelty_folds=0"], "apply to ORCA alone"),
        (["--method", "ORCA", "--jobs", "0"], "--jobs"),
        (["--method", "ORCA", "--set", "no_such_option=1"], "no_such_option"),
        (["--method", "ORCA", "--set", "epochs"], "is not key=value"),
        (["--suite", "dev", "--only", "no_such_task"], "no task name is or contains"),
    ]:
        assert_cli_error(CliRunner().invoke(main, ["benchmark", "--quick", *args, *out]), msg)
        assert not (tmp_path / "o").exists()


def test_set_values_parse_as_the_options_expect():
    from orca_sc.benchmark._devsuite import config_overrides

    got = config_overrides(["epochs=5", "cross_fit_threshold=true", "self_check=FALSE",
                            "merge_threshold=None", "pair_space=pca", "lr=1e-3"])  # fmt: skip
    assert got == {"epochs": 5, "cross_fit_threshold": True, "self_check": False,
                   "merge_threshold": None, "pair_space": "pca", "lr": 1e-3}  # fmt: skip
    assert type(got["cross_fit_threshold"]) is bool
    with pytest.raises(ValueError, match="key=value"):
        config_overrides(["epochs"])


def test_suite_runs_are_pinned_to_the_thread_count_it_started_with(monkeypatch):
    """Scanpy's numba kernels (which the suite's integration figures run after each task) set the
    OpenMP thread count that torch shares to the number of CPUs; every run of the suite is
    pinned to the count the suite started with, and the caller's count is restored after.
    """
    import torch

    from orca_sc.benchmark import _devsuite
    from orca_sc.benchmark._suite import SimSetting, make_sim_task
    from orca_sc.benchmark._tasks import TaskSpec

    seen, real = [], _devsuite.annotate_task

    def recording(task, seed, **config):
        seen.append(torch.get_num_threads())
        torch.set_num_threads(2)  # as a scanpy call inside a run would
        return real(task, seed, **config)

    monkeypatch.setattr(_devsuite, "annotate_task", recording)
    setting = SimSetting("threads", n_ref=300, n_query=150, n_genes=200)
    spec = TaskSpec("sim_threads", "cross-batch", lambda s: make_sim_task(setting, s), "")
    fast = {"epochs": 2, "warmup_epochs": 1, "epoch_min_steps": 10, "novelty_folds": 0}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        runs = B.run_orca_suite([spec], [0, 1], fast, progress=False)
        assert seen == [1, 1] and len(runs) == 2
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_suite_runs_in_worker_processes_give_the_rows_of_one_process():
    """``jobs=2`` shares the runs among two fresh worker processes at one thread each: every
    figure of every row is the one-process suite's at one thread, in the same order; the
    caller's thread count is left as it was.
    """
    from functools import partial

    import torch

    from orca_sc.benchmark._suite import SimSetting, make_sim_task
    from orca_sc.benchmark._tasks import TaskSpec

    setting = SimSetting("jobs", n_ref=300, n_query=150, n_genes=200, n_seen=4, n_novel=2)
    spec = TaskSpec("sim_jobs", "cross-batch", partial(make_sim_task, setting), "")
    fast = {"epochs": 3, "warmup_epochs": 1, "epoch_min_steps": 7}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(ValueError, match="jobs"):
            B.run_orca_suite([spec], [0], fast, progress=False, jobs=0)
        parallel = B.run_orca_suite([spec], [0, 1, 2], fast, progress=False, jobs=2)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        serial = B.run_orca_suite([spec], [0, 1, 2], fast, progress=False)
    finally:
        torch.set_num_threads(before)
    timing = [c for c in serial.columns if c.endswith("seconds") or c == "peak_mb"]
    assert list(parallel["seed"]) == [0, 1, 2] and set(parallel["torch_threads"]) == {1}
    pd.testing.assert_frame_equal(parallel.drop(columns=timing), serial.drop(columns=timing))
    # the seeds' runs differ: the comparison is of real figures, not of empty rows
    assert parallel["threshold"].nunique() > 1


def test_baseline_runs_in_worker_processes_give_the_rows_of_one_process():
    """``run_benchmark(jobs=2)``: each task and seed's methods in a worker at one thread, the
    rows those of one process at one thread, in the same order.
    """
    from functools import partial

    import torch

    from orca_sc.benchmark._suite import SimSetting, make_sim_task
    from orca_sc.benchmark._tasks import TaskSpec

    setting = SimSetting("jobs", n_ref=300, n_query=150, n_genes=200, n_seen=4, n_novel=2)
    spec = TaskSpec("sim_jobs", "cross-batch", partial(make_sim_task, setting), "")
    methods = ["LR + oracle reject + KMeans", "kNN transfer (ingest-like) + Leiden"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        parallel = B.run_benchmark([spec], methods, [0, 1], progress=False, jobs=2)
        torch.set_num_threads(1)
        serial = B.run_benchmark([spec], methods, [0, 1], progress=False)
    finally:
        torch.set_num_threads(before)
    assert parallel.settings["torch_threads"] == serial.settings["torch_threads"] == 1
    timing = ["seconds", "peak_mb"]
    assert list(parallel.runs["method"]) == methods * 2
    pd.testing.assert_frame_equal(
        parallel.runs.drop(columns=timing), serial.runs.drop(columns=timing)
    )


def test_own_h5ad_task_runs_in_worker_processes(sim, tmp_path):
    """``--h5ad`` with ``--jobs 2``: the workers build the task from the file and give the
    rows of one process at the same thread count.
    """
    import torch

    path = tmp_path / "atlas.h5ad"
    sim.write_h5ad(path)
    args = ["benchmark", "--h5ad", str(path), "--labels-key", "cell_type", "--batch-key",
            "batch", "--reference-batches", "batch_0", "--novel-classes", "type_4",
            "--method", "ORCA", "--seeds", "0,1", "--no-scaling", "-q", "--set", "epochs=3",
            "--set", "warmup_epochs=1", "--set", "epoch_min_steps=7"]  # fmt: skip
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        runs = {}
        for jobs in ("1", "2"):
            out = tmp_path / f"jobs{jobs}"
            r = CliRunner().invoke(main, [*args, "--jobs", jobs, "--outdir", str(out)])
            assert r.exit_code == 0, (r.output, r.exception)
            runs[jobs] = pd.read_csv(out / "runs.csv")
    finally:
        torch.set_num_threads(before)
    timing = [c for c in runs["1"].columns if c.endswith("seconds") or c == "peak_mb"]
    assert list(runs["2"]["task"]) == ["atlas_cross_batch"] * 2
    pd.testing.assert_frame_equal(runs["2"].drop(columns=timing), runs["1"].drop(columns=timing))


def test_one_run_with_jobs_stays_in_process_at_every_thread(sim, tmp_path):
    """``--jobs 2`` with a single run (one task, one seed): no worker is started, the run has
    all the threads, and ``settings.json`` records the count the run had. (A process of its own
    at two threads, so that this test's thread count leaves the other tests' figures alone.)
    """
    import json
    import os
    import subprocess
    import sys

    path = tmp_path / "atlas.h5ad"
    sim.write_h5ad(path)
    out = tmp_path / "one"
    args = ["benchmark", "--h5ad", str(path), "--labels-key", "cell_type", "--batch-key",
            "batch", "--reference-batches", "batch_0", "--method", "ORCA", "--seeds", "0",
            "--no-scaling", "-q", "--set", "epochs=2", "--set", "warmup_epochs=1", "--set",
            "epoch_min_steps=5", "--jobs", "2", "--outdir", str(out)]  # fmt: skip
    pools = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
    env = os.environ | dict.fromkeys(pools, "2")
    r = subprocess.run([sys.executable, "-m", "orca_sc", *args], env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    runs = pd.read_csv(out / "runs.csv")
    settings = json.loads((out / "settings.json").read_text())
    assert list(runs["torch_threads"]) == [2]
    assert settings["torch_threads"] == 2 and settings["jobs"] == 2


def test_map_runs_keeps_the_order_and_refuses_bad_jobs():
    from orca_sc.benchmark._run import map_runs, worker_threads

    assert worker_threads(8, 2, 5) == 4 and worker_threads(8, 2, 1) == 8
    assert worker_threads(1, 4, 9) == 1 and worker_threads(8, 1, 9) == 8
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="jobs must be a positive integer"):
            list(map_runs(divmod, [(7,)], bad, 2))
    # in one process (at the caller's thread count, which it sets back): divmod(a, threads)
    import torch

    n = torch.get_num_threads()
    assert list(map_runs(divmod, [(7,), (9,)], 1, n)) == [divmod(7, n), divmod(9, n)]
    assert torch.get_num_threads() == n
    # in two workers at 4 // 2 threads each, in the order of the work
    assert list(map_runs(divmod, [(7,), (9,), (11,)], 2, 4)) == [(3, 1), (4, 1), (5, 1)]


def test_runs_count_the_clusters_each_vote_added_or_dropped():
    """``query_vote_extra`` counts the query clusters taken beyond the share vote,
    ``share_vote_dropped`` those the share vote took that its test left out; a run without a
    query batch has neither.
    """
    from orca_sc.benchmark._devsuite import _share_dropped, _vote_extra

    votes = {"share": [True, True, False, False], "candidate": [True, False, True, False]}
    assert _vote_extra(votes) == 1 and _share_dropped(votes) == 1
    assert _vote_extra(None) == 0 and _share_dropped(None) == 0
