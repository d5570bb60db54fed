"""The backbone's self-supervised pretraining (``Ablation.pretrain``, a study's setting):
its loss and views, its reproducibility, the warm-ups that start from it, and a whole run.
"""

import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from conftest import FAST, FAST_LAB, hidden_type_pair

import orca_sc
from orca_sc import OrcaConfig
from orca_sc._ablation import Ablation
from orca_sc._cells import CellMatrix
from orca_sc._pretrain import TEMPERATURE, corrupt, pretrain_backbone
from orca_sc._train import TrainRandom, fit_warmup, schedule
from orca_sc.losses import nt_xent


def test_nt_xent_hand_computed_and_lowest_when_the_views_agree():
    # two cells, views identical and orthogonal, temperature 1: each view's partner has cosine
    # 1 and the two other views 0, so the loss is log((e + 2) / e)
    e = torch.eye(2)
    loss = float(nt_xent(e, e, TEMPERATURE))
    assert TEMPERATURE == 1.0 and math.isclose(loss, math.log((math.e + 2) / math.e), rel_tol=1e-5)
    # views that pair each cell with the other cell's view score worse
    assert float(nt_xent(e, e.flip(0), TEMPERATURE)) > loss + 1.0


def test_a_corrupted_view_takes_each_replaced_value_from_the_same_gene_of_another_cell():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.gamma(1.0, 1.0, (300, 40)).astype(np.float32))
    view = corrupt(x, 0.6, torch.Generator().manual_seed(1))
    changed = view != x
    assert abs(float(changed.float().mean()) - 0.6) < 0.05  # a few draws pick the cell itself
    for g in range(x.shape[1]):  # loop over genes: every new value is in that gene's column
        assert torch.isin(view[changed[:, g], g], x[:, g]).all()
    again = corrupt(x, 0.6, torch.Generator().manual_seed(1))
    assert torch.equal(view, again)


def _cells(seed=0):
    a = orca_sc.datasets.simulate(600, 200, 4, markers_per_type=20, marker_fold=4.0, seed=seed)
    X = sp.csr_matrix(np.log1p(a.X), dtype=np.float32)
    y = a.obs["cell_type"].cat.codes.to_numpy().astype(np.int64)
    g = X.shape[1]
    cells = CellMatrix(X, np.zeros(X.shape[0], dtype=int), np.ones((1, g), np.float32),
                       np.zeros((1, g), np.float32), torch.device("cpu"))  # fmt: skip
    return cells, y


def test_pretraining_is_reproducible_learns_and_leaves_the_global_stream_alone():
    cells, _ = _cells()
    cfg = OrcaConfig(hidden_dims=(64, 32), progress=False)
    lab = Ablation(pretrain="scarf", pretrain_steps=40)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    state, record = pretrain_backbone(cells, cfg, lab, seed=0)
    assert torch.equal(torch.random.get_rng_state(), before)
    again, _ = pretrain_backbone(cells, cfg, lab, seed=0)
    other, _ = pretrain_backbone(cells, cfg, lab, seed=1)
    assert all(torch.equal(state[k], again[k]) for k in state)
    assert not torch.equal(state["net.0.weight"], other["net.0.weight"])
    assert record["steps"] == 40 and record["loss_last"] < record["loss_first"] - 0.3


def test_a_warm_up_from_the_pretrained_backbone_keeps_its_first_layer_only_when_frozen():
    cells, y = _cells()
    labels = np.where(y < 3, y, -1)
    cfg = OrcaConfig(hidden_dims=(64, 32), epochs=4, warmup_epochs=2, progress=False)
    state, _ = pretrain_backbone(cells, cfg, Ablation(pretrain="scarf", pretrain_steps=20), 0)
    for freeze in (True, False):
        lab = FAST_LAB.replace(pretrain="scarf", pretrain_freeze=freeze)
        plan = schedule(cells.shape[0], cfg, lab)
        net, _ = fit_warmup(cells, labels, 3, cfg, plan, TrainRandom(0, cells.device), lab=lab,
                            init=state)  # fmt: skip
        after = net.backbone.state_dict()
        kept = torch.equal(after["net.0.weight"], state["net.0.weight"])
        assert kept == freeze
        assert not torch.equal(after["net.4.weight"], state["net.4.weight"])  # the second layer
        assert net.backbone.first_layer.weight_t.requires_grad == (not freeze)


@pytest.mark.parametrize("pairs", ["cell", "mnn", "vouched"])
def test_a_run_with_a_pretrained_backbone_records_it_and_finds_the_hidden_type(pairs):
    ref, query = hidden_type_pair()
    lab = FAST_LAB.replace(pretrain="scarf", pretrain_steps=50, pretrain_freeze=False,
                           pretrain_pairs=pairs)  # fmt: skip
    out = orca_sc.tl.annotate(query, ref, labels_key="cell_type", copy=True, seed=0,
                              **{**FAST, "ablation": lab})  # fmt: skip
    record = out.uns["orca"]["training"]["pretrain"]
    assert record["method"] == "scarf" and record["steps"] == 50
    assert record["frozen_first_layer"] is False and record["loss_last"] < record["loss_first"]
    assert record["cells"] == query.n_obs + ref.n_obs and record["pairs"] == pairs
    # pairs across the batches: a share of each batch's cells take a partner's view
    assert (record["paired_share"] > 0.05) == (pairs != "cell")
    truth = query.obs["cell_type"].astype(str).to_numpy()
    novel = out.obs["orca_novel"].notna().to_numpy()
    assert novel[truth == "type_4"].mean() > 0.8 and novel[truth != "type_4"].mean() < 0.1


def test_batch_partners_pair_across_the_batches_both_ways_and_mostly_within_a_type():
    from orca_sc._pretrain import batch_partners

    rng = np.random.default_rng(0)
    centre = np.eye(5) * 5
    # labelled batch: types 0 and 1; query batch: type 0 and a type the reference lacks (2)
    truth = np.r_[np.zeros(50, int), np.ones(50, int), np.zeros(40, int), np.full(30, 2)]
    pcs = centre[truth] + rng.normal(0, 1, (truth.size, 5))
    labels = np.r_[truth[:100], -np.ones(70, int)]
    domain = np.r_[np.zeros(100, int), np.ones(70, int)]
    ptr, idx = batch_partners(pcs, labels, domain, k=10)
    assert ptr.shape == (171,) and ptr[-1] == idx.size > 0
    pairs = {(i, int(j)) for i in range(170) for j in idx[ptr[i] : ptr[i + 1]]}
    assert all(domain[i] != domain[j] for i, j in pairs)  # across the batches only
    assert all((j, i) in pairs for i, j in pairs)  # mutual
    shared = [(i, j) for i, j in pairs if truth[i] == 0 and domain[i] == 1]
    assert shared and np.mean([truth[j] == 0 for _, j in shared]) > 0.9


def test_vouched_pairs_keep_only_a_query_cell_its_warm_up_scores_as_its_partner_s_type():
    from orca_sc._pretrain import batch_partners, vouched_labels

    rng = np.random.default_rng(1)
    centre = np.eye(5) * 5
    # labelled batch: types 0 and 1; query: type 0 and a type 2 whose nearest labelled type is 1
    truth = np.r_[np.zeros(50, int), np.ones(50, int), np.zeros(40, int), np.full(30, 2)]
    pcs = centre[truth] + rng.normal(0, 1, (truth.size, 5))
    pcs[truth == 2] = centre[1] * 0.4 + rng.normal(0, 1, ((truth == 2).sum(), 5))
    labels = np.r_[truth[:100], -np.ones(70, int)]
    domain = np.r_[np.zeros(100, int), np.ones(70, int)]
    # a warm-up's cosines: each type's own head high, type 2 claimed by head 1 but far below it
    similarity = np.where(np.arange(2) == np.minimum(truth, 1)[:, None], 0.9, 0.1)
    similarity = similarity + rng.normal(0, 0.02, similarity.shape)
    similarity[truth == 2, 1] = 0.5
    vouch = vouched_labels(similarity, labels)
    assert np.array_equal(vouch[:100], labels[:100])  # a labelled cell vouches for its label
    assert (vouch[100:140] == 0).mean() > 0.9 and (vouch[140:] == -1).all()
    _, all_idx = batch_partners(pcs, labels, domain, k=10)
    ptr, idx = batch_partners(pcs, labels, domain, k=10, vouch=vouch)
    assert 0 < idx.size < all_idx.size
    pairs = [(i, int(j)) for i in range(170) for j in idx[ptr[i] : ptr[i + 1]]]
    assert all(truth[i] != 2 and truth[j] != 2 for i, j in pairs)  # the new type has none
    assert all(truth[i] == truth[j] for i, j in pairs)
    # without the vouching the new type's cells pair with labelled cells of type 1
    all_ptr = batch_partners(pcs, labels, domain, k=10)[0]
    assert any(all_ptr[i + 1] > all_ptr[i] for i in np.flatnonzero(truth == 2))


def test_the_pretraining_settings_are_checked_with_one_clear_error_each():
    from orca_sc._errors import ConfigError

    for bad, fragment in (
        ({"pretrain": "simclr"}, '"none", "scarf" or "mask"'),
        ({"pretrain_steps": 0}, "a positive integer"),
        ({"pretrain_corruption": 1.0}, "[0, 1)"),
        ({"pretrain_cells": "query"}, '"all" or "labelled"'),
        ({"pretrain_pairs": "mnn", "pretrain_cells": "labelled"}, "partners are of other"),
        ({"pretrain_pairs": "vouched", "pretrain_cells": "labelled"}, "partners are of other"),
        ({"pretrain_pairs": "knn"}, '"cell", "mnn" or "vouched"'),
        ({"pretrain_freeze": "yes"}, "True or False"),
    ):
        with pytest.raises(ConfigError, match=None) as err:
            Ablation(**bad)
        assert fragment in str(err.value), (bad, str(err.value))
