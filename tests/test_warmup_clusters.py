"""The warm-ups' cluster term (``Ablation.warmup_clusters``, a study of "ORCA core 5"): a second
cosine head learns each cell's Leiden cluster, cut per batch or over all batches.
"""

import anndata as ad
import numpy as np
from conftest import FAST_LAB, FAST_OPTIONS, hidden_type_pair

import orca_sc
from orca_sc._context import run_context
from orca_sc._loss import OrcaLoss
from orca_sc._train import CellBatches, TrainRandom, fit_warmup


def _run(**lab):
    """The hidden-type pair as one AnnData (the query's labels removed) and its run context."""
    ref, query = hidden_type_pair()
    a = ad.concat([ref, query], merge="same")
    a.obs_names_make_unique()
    truth = a.obs["cell_type"].astype(str).to_numpy()
    a.obs["cell_type"] = list(truth[: ref.n_obs]) + [None] * query.n_obs
    a.obs["batch"] = ["ref"] * ref.n_obs + ["query"] * query.n_obs
    cfg = orca_sc.OrcaConfig(**{**FAST_OPTIONS, "batch_key": "batch"})
    return run_context(a, None, "cell_type", cfg, FAST_LAB.replace(**lab)), truth


def test_the_targets_are_the_query_s_own_clusters_or_every_cell_s_joint_ones():
    run, truth = _run(warmup_clusters=1.0)
    t, labels, domain = run.warmup_cluster_targets, run.data.labels, run.data.domain
    assert (t[labels >= 0] == -1).all() and (t[labels < 0] >= 0).all()  # per batch: unlabelled
    # the hidden type is a cluster of its own: most of its cells share one code, few others do
    hidden = truth == "type_4"
    code = np.bincount(t[hidden]).argmax()
    assert (t[hidden] == code).mean() > 0.9 and (t[~hidden] == code).mean() < 0.02
    joint, _ = _run(warmup_clusters=1.0, warmup_clusters_space="joint")
    j = joint.warmup_cluster_targets
    assert (j >= 0).all()
    # a known type's cells of both batches share their clusters across the batches
    for k in ("type_0", "type_1"):
        code = np.bincount(j[truth == k]).argmax()
        both = [(j[(truth == k) & (domain == b)] == code).mean() for b in np.unique(domain)]
        assert min(both) > 0.5
    plain, _ = _run()
    assert plain.warmup_cluster_targets is None  # without the term


def test_a_warm_up_with_the_term_learns_the_clusters_and_returns_a_plain_net():
    run, _ = _run(warmup_clusters=1.0)
    t, labels = run.warmup_cluster_targets, run.data.labels
    lab, cfg, cells = run.lab, run.config, run.cells
    loss = OrcaLoss(cells, labels, cfg, run.plan, None, full=False, lab=lab, cluster_targets=t)
    assert set(loss.unlabelled_rows) == set(np.flatnonzero(labels < 0))  # the query's cells join
    epoch = CellBatches(cells, labels, run.plan, TrainRandom(0, cells.device), False, None,
                        loss.unlabelled_rows).epoch(0)  # fmt: skip
    assert set(np.concatenate(epoch)) == set(range(labels.size))
    nets = {}
    for w in (0.0, 1.0):
        lab_w = lab.replace(warmup_clusters=w)
        nets[w], history = fit_warmup(cells, labels, run.n_seen, cfg, run.plan,
                                      TrainRandom(0, cells.device), lab=lab_w,
                                      cluster_targets=t)  # fmt: skip
        assert not hasattr(nets[w], "cluster_head")  # the head does not outlive the warm-up
        term = [h["regularizer"] for h in history]
        assert (term[-1] < 0.7 * term[0]) if w else max(term) == 0.0  # read only with a weight
    again, _ = fit_warmup(cells, labels, run.n_seen, cfg, run.plan, TrainRandom(0, cells.device),
                          lab=lab, cluster_targets=t)  # fmt: skip
    state, other = nets[1.0].state_dict(), nets[0.0].state_dict()
    assert set(state) == set(other)  # a model file of the usual keys
    assert all(np.array_equal(state[k], again.state_dict()[k]) for k in state)  # same seed
    assert not np.array_equal(state["head.weight"], other["head.weight"])


def test_a_run_with_the_term_finds_the_hidden_type():
    ref, query = hidden_type_pair()
    lab = FAST_LAB.replace(warmup_clusters=1.0, warmup_clusters_space="harmony")
    out = orca_sc.tl.annotate(query, ref, labels_key="cell_type", copy=True, seed=0,
                              **{**FAST_OPTIONS, "ablation": lab})  # fmt: skip
    truth = query.obs["cell_type"].astype(str).to_numpy()
    novel = out.obs["orca_novel"].notna().to_numpy()
    assert novel[truth == "type_4"].mean() > 0.8 and novel[truth != "type_4"].mean() < 0.1
