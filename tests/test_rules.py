"""Discovery as an ordered list of rules: each rule decides one thing, the record and the
method's prose come from the list, a rule left out of the list decides nothing; the user's
options are few and the method's settings live in the benchmark's ``Ablation``.
"""

import dataclasses
import importlib
import math

import numpy as np
import pytest
from conftest import SHARED_DATA

import orca_sc
from orca_sc._ablation import Ablation, DiscoveryRules, split_options
from orca_sc._config import resolve_config
from orca_sc._discover import DiscoveryInput, discover
from orca_sc._discover.rules import OTHER_STAGES, RULES, Candidates, DiscoveryState, run_rules


def _two_batches(seed=0):
    """A labelled batch of three types and a query batch of the same three plus a fourth type
    far from all of them; the seen "heads" are the labelled class means.
    """
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(4, 8)) * 4
    ref = np.repeat(np.arange(3), 80)
    qry = np.repeat(np.arange(4), 60)
    truth = np.concatenate([ref, qry])
    x = centers[truth] + rng.normal(size=(truth.size, 8))
    labels = np.concatenate([ref, np.full(qry.size, -1)])
    domain = np.concatenate([np.zeros(ref.size, int), np.ones(qry.size, int)])
    emb = x / np.linalg.norm(x, axis=1, keepdims=True)
    heads = np.stack([emb[labels == k].mean(0) for k in range(3)])
    heads /= np.linalg.norm(heads, axis=1, keepdims=True)
    cells = DiscoveryInput(emb, emb @ heads.T, labels, domain, lambda i: x[i],
                           domain_names=["reference", "query"])  # fmt: skip
    return cells, truth


def _evidence(cells, cfg=None):
    return DiscoveryState(
        cells.embedding, cells.seen_similarity, cells.labels, cells.domain, cells.pca_of,
        np.zeros(cells.labels.size, bool), None, cells.domain_names, None,
        cfg or DiscoveryRules(), "auto", 0,
    )  # fmt: skip


def test_discover_runs_the_list_and_its_record_comes_from_the_rules():
    cells, truth = _two_batches()
    found = discover(cells)
    # the query's fourth type is the one candidate, found by the query vote
    assert found.n_novel == 1
    members = np.flatnonzero(found.assign == 0)
    assert (truth[members] == 3).mean() > 0.95 and members.size >= 50
    e = _evidence(cells)
    record = run_rules(e)
    for key in ("n_supported_by_labels", "resolution", "threshold_in_sample", "query_votes",
                "n_anchored", "n_held_on_seen_heads"):  # fmt: skip
        assert key in record and key in found.diagnostics, key
    # the method's prose is the rules' clauses, in order
    assert record["method"] == "".join(rule.describe(e) for rule in RULES)
    assert record["method"].startswith("Leiden clusters (resolution")
    assert "; in batches without labels" in record["method"]
    assert found.diagnostics["method"] == record["method"]


def test_a_rule_left_out_of_the_list_decides_nothing():
    cells, _ = _two_batches()
    whole = run_rules(_evidence(cells))
    assert sum(whole["query_votes"]["candidate"]) == 1
    without = tuple(r for r in RULES if r.name != "query vote")
    e = _evidence(cells)
    record = run_rules(e, without)
    assert "query_votes" not in record and e.groups == [] and e.sizes == []
    assert "; in batches without labels" not in record["method"]


def test_each_droppable_part_of_a_rule_is_switched_off_by_name():
    cells, truth = _two_batches()
    whole = run_rules(_evidence(cells))
    # without the share vote, no cluster is taken by it; without both votes, none is taken
    e = _evidence(cells, DiscoveryRules(drop="share_vote"))
    record = run_rules(e)
    assert not any(record["query_votes"]["share"]) and sum(whole["query_votes"]["share"]) >= 1
    e = _evidence(cells, DiscoveryRules(drop=("share_vote", "contrast_vote")))
    assert run_rules(e)["query_votes"]["candidate"] == [False] * len(e.votes) and e.groups == []
    # the resolution falls back to the constant, not calibrated on the labels
    rules = DiscoveryRules(drop="resolution", fallback_resolution=0.25)
    assert run_rules(_evidence(cells, rules))["resolution"] == 0.25
    # no label evidence: nothing supported, no desert
    record = run_rules(_evidence(cells, DiscoveryRules(drop="label_support")))
    assert record["n_supported_by_labels"] == 0 and record["n_label_deserts"] == 0
    with pytest.raises(ValueError, match="names of rule parts"):
        DiscoveryRules(drop="threshold")
    assert Ablation.of(drop="share_vote").rules == {"drop": "share_vote"}


def test_a_query_cut_checked_on_the_labelled_cells_is_recorded_per_batch():
    """``query_resolution="reference"`` (a study's setting): the query batch is cut at the
    resolution its labelled sample keeps whole, which the record and the prose give; the
    fourth type is still the one candidate.
    """
    cells, truth = _two_batches()
    rules = DiscoveryRules(query_resolution="reference", query_resolution_grid=(0.5, 1.0, 2.0))
    e = _evidence(cells, rules)
    record = run_rules(e)
    chosen = record["query_resolution"]["query"]
    assert chosen["resolution"] in (0.5, 1.0, 2.0)
    assert chosen["types_whole"][f"{chosen['resolution']:g}"] == 1.0
    assert set(chosen["types_whole"]) == {"0.5", "1", "2"}
    assert "keeps every labelled type whole" in record["method"]
    assert sum(record["query_votes"]["candidate"]) == 1
    (members,) = e.groups
    assert (truth[members] == 3).mean() > 0.95
    assert "query_resolution" not in run_rules(_evidence(cells))


def test_every_rule_says_what_it_does_and_every_other_stage_names_a_real_function():
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names) and all(names)
    for rule in RULES:
        assert len(type(rule).__doc__.split()) > 15, type(rule).__name__
    assert isinstance(RULES[4], Candidates)  # candidates after the threshold that cuts them
    for other in OTHER_STAGES:
        module, _, attr = other.where.rpartition(".")
        assert callable(getattr(importlib.import_module(module), attr)), other.where


def test_the_users_options_are_few_and_the_methods_settings_are_an_ablation():
    n_user = len(dataclasses.fields(orca_sc.OrcaConfig)) + len(
        dataclasses.fields(orca_sc.DiscoveryConfig)
    )
    assert n_user <= 30
    # a method setting given as an option is refused, and the message says where it lives
    with pytest.raises(TypeError, match="not options.*Ablation"):
        resolve_config(None, "annotate()", margin="zero")
    options, lab = split_options({"epochs": 4, "margin": "zero", "ood_quantile": 0.02})
    assert options == {"epochs": 4} and lab.margin == "zero"
    assert DiscoveryRules.of(orca_sc.DiscoveryConfig(), lab).ood_quantile == 0.02
    assert lab.changes() == {"margin": "zero", "ood_quantile": 0.02}
    assert split_options({"epochs": 4}) == ({"epochs": 4}, None)
    with pytest.raises(ValueError, match="Unknown discovery rule constants"):
        Ablation(rules={"bogus": 1})


@pytest.mark.parametrize("n_cells", [480, 5_000, 50_000])
def test_fewer_epochs_always_train_fewer_steps(n_cells):
    """The floor of optimiser steps on small data is per epoch: a run of fewer epochs is never
    longer (a fixed floor of 300 steps gave a 6-epoch run on 480 cells a 250-step warm-up
    against the default's 75).
    """
    from orca_sc._train import schedule

    def steps(epochs):
        cfg = orca_sc.OrcaConfig(epochs=epochs, warmup_epochs=min(5, epochs - 1))
        plan = schedule(n_cells, cfg)
        return plan.n_epochs * plan.steps_per_epoch, plan.warmup * plan.steps_per_epoch

    default_total, default_warm = steps(20)
    assert default_total >= 300 and default_total == max(300, 20 * math.ceil(n_cells / 512))
    for epochs in (2, 6, 10):
        total, warm = steps(epochs)
        assert total < default_total and warm <= default_warm, epochs


def _sibling_states(seed=0, shift=1.5):
    """A known type's labelled cells in two states (70% / 30%), and a query batch, shifted as a
    whole, holding the same two states and a third state of the type's neighbourhood (a novel
    sibling) that no labelled cell has. Returns the labelled cells and the query's three states.
    """
    rng = np.random.default_rng(seed)
    dims = 10
    states = np.zeros((3, dims))
    states[1, 0] = 6.0  # the type's second state
    states[2, 1] = 6.0  # the sibling, as far from the type's first state in another direction
    batch = rng.normal(size=dims)
    batch *= shift / np.linalg.norm(batch)
    labelled = np.concatenate([states[0] + rng.normal(size=(140, dims)),
                               states[1] + rng.normal(size=(60, dims))])  # fmt: skip
    query = [states[k] + batch + rng.normal(size=(n, dims)) for k, n in enumerate((150, 60, 60))]
    return labelled, query


def test_the_absence_vote_takes_a_state_the_type_s_labelled_cells_lack():
    from orca_sc._discover.query import absence_pvalue

    def absent(inside, outside, labelled, level=0.01):
        p = absence_pvalue(inside, outside, labelled)
        return p is not None and p <= level

    labelled, (first, second, sibling) = _sibling_states()
    # the sibling: no labelled cell of the type past the midpoint from the type's other cells
    assert absence_pvalue(sibling, np.concatenate([first, second]), labelled) < 1e-3
    # the type's second state, a piece of it: its labelled cells hold it
    assert absence_pvalue(second, np.concatenate([first, sibling]), labelled) > 0.5
    # the batch's residual shift (what the alignment leaves) moves neither call; a shift along
    # the axis as large as half the distance to the sibling would (a limit of the vote)
    for seed in range(1, 6):
        labelled, (first, second, sibling) = _sibling_states(seed)
        assert absent(sibling, np.concatenate([first, second]), labelled)
        assert not absent(second, np.concatenate([first, sibling]), labelled)
    # five labelled cells cannot show that a state is missing; a cluster that is most of the
    # type's cells in the batch is the type itself and is not read
    assert not absent(sibling, np.concatenate([first, second]), labelled[:5])
    assert absence_pvalue(first, np.concatenate([second, sibling])[:100], labelled) is None


def test_the_query_vote_s_absence_vote_is_a_study_off_by_default():
    """With the share and contrast votes switched off, the absence vote alone takes the query's
    novel sibling of a known type, and no cluster of the known types; off by default, and its
    p-values recorded only when on.
    """
    rng = np.random.default_rng(0)
    labelled, (first, second, sibling) = _sibling_states()
    others = rng.normal(size=(2, 10)) * 6  # two more known types, far from the first
    ref = [labelled] + [c + rng.normal(size=(80, 10)) for c in others]
    qry = [first, second, sibling] + [c + rng.normal(size=(60, 10)) for c in others]
    x = np.concatenate(ref + qry)
    labels = np.concatenate([np.full(len(r), k) for k, r in enumerate(ref)]
                            + [np.full(len(q), -1) for q in qry])  # fmt: skip
    n_ref = sum(len(r) for r in ref)
    state = np.concatenate([np.full(n_ref, -1)] + [np.full(len(q), k) for k, q in enumerate(qry)])
    domain = (labels < 0).astype(int)
    # the seen heads: each type's labelled mean, on embeddings the type's head claims
    emb = x / np.linalg.norm(x, axis=1, keepdims=True)
    heads = np.stack([x[labels == k].mean(0) for k in range(3)])
    claim = np.argmin(((x[:, None, :] - heads[None]) ** 2).sum(-1), axis=1)
    sim = np.eye(3)[claim] * 0.9 + 0.05  # each cell claimed by its nearest type, confidently
    cells = DiscoveryInput(emb, sim, labels, domain, lambda i: x[i],
                           domain_names=["reference", "query"])  # fmt: skip
    off = ("share_vote", "contrast_vote")
    e = _evidence(cells, DiscoveryRules(drop=off, absence_vote=True))
    record = run_rules(e)
    assert "absence_p" in record["query_votes"]
    (members,) = e.groups  # the sibling's cells (state 2), hardly any other
    assert (state[members] == 2).mean() > 0.9 and (state[members] == 2).sum() > 50
    e = _evidence(cells, DiscoveryRules(drop=off))
    record = run_rules(e)
    assert e.groups == [] and "absence_p" not in record["query_votes"]
    assert not DiscoveryRules().absence_vote


@pytest.mark.skipif(
    not (SHARED_DATA / "pbmc_sorted_vs_3k.h5ad").exists(), reason="shared data absent"
)
def test_the_absence_vote_finds_the_fcgr3a_monocytes_the_sorted_cd14_head_claims():
    """Real data: pbmc3k annotated against the bead-sorted PBMC populations. Its FCGR3A+
    monocytes score like the sorted CD14+ monocytes on that head, so the defaults keep them
    known; the sorted CD14+ monocytes lack their state, and the absence vote calls them novel
    while pbmc3k's own CD14+ monocytes stay known.
    """
    from orca_sc.benchmark import annotate_task, dev_suite

    (spec,) = dev_suite(SHARED_DATA, large=False, only=["pbmc_sorted_to_3k"])
    task = spec.make(0)
    share = {}
    for on in (False, True):
        adata, rows = annotate_task(task, 0, absence_vote=on)
        query = adata[rows]
        novel = query.obs["orca_novel"].notna().to_numpy()
        truth = query.obs["truth"].astype(str).to_numpy()
        share[on] = {t: novel[truth == t].mean() for t in ("FCGR3A+ Mono", "CD14+ Mono")}
        assert ("absence_p" in query.uns["orca"]["estimate"]["query_votes"]) == on
    assert share[False]["FCGR3A+ Mono"] < 0.1
    assert share[True]["FCGR3A+ Mono"] > 0.8 and share[True]["CD14+ Mono"] < 0.1
