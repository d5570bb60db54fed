"""Discovery as an ordered list of rules: each rule decides one thing, the record and the
method's prose come from the list, a rule left out of the list decides nothing; the user's
options are few and the method's settings live in the benchmark's ``Ablation``.
"""

import dataclasses
import importlib
import math

import numpy as np
import pytest

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
