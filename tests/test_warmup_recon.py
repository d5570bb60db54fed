"""The warm-ups' reconstruction term (``Ablation.warmup_recon``, a study of "ORCA core 5"): a
decoder given a cell's embedding and its batch rebuilds the cell's input.
"""

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from conftest import FAST, FAST_LAB, hidden_type_pair

import orca_sc
from orca_sc import OrcaConfig
from orca_sc._ablation import Ablation
from orca_sc._cells import CellMatrix
from orca_sc._errors import ConfigError
from orca_sc._loss import OrcaLoss
from orca_sc._train import CellBatches, TrainRandom, fit_warmup, schedule
from orca_sc.module import BatchDecoder, dense_input


def _cells(layout="auto"):
    """Two batches of four simulated types, the second shifted gene by gene (an offset)."""
    a = orca_sc.datasets.simulate(600, 200, 4, n_batches=2, markers_per_type=20, marker_fold=4.0,
                                  seed=0)  # fmt: skip
    X = sp.csr_matrix(np.log1p(a.X), dtype=np.float32)
    y = a.obs["cell_type"].cat.codes.to_numpy().astype(np.int64)
    b = a.obs["batch"].cat.codes.to_numpy().astype(np.int64)
    g = X.shape[1]
    offset = np.zeros((2, g), np.float32)
    offset[1] = np.random.default_rng(1).normal(0, 0.2, g)
    cells = CellMatrix(X, b, np.ones((2, g), np.float32), offset, torch.device("cpu"), layout)
    return cells, y, b


def test_a_sparse_mini_batch_reads_as_the_dense_rows_the_first_layer_takes():
    sparse, _, _ = _cells("sparse")
    rows = np.array([0, 5, 599, 300, 42])
    x = sparse.batch(rows)
    assert not isinstance(x, torch.Tensor)  # SparseRows: the offset is not yet added
    assert torch.allclose(dense_input(x), sparse.dense_batch(rows), atol=1e-6)
    dense, _, _ = _cells("dense")
    assert torch.allclose(dense_input(dense.batch(rows)), sparse.dense_batch(rows), atol=1e-6)


def test_the_decoder_reads_the_batch_as_well_as_the_embedding():
    torch.manual_seed(0)
    dec = BatchDecoder(8, 3, 20, hidden=16)
    z = torch.randn(4, 8)
    out = [dec(z, torch.full((4,), b)) for b in range(3)]
    assert out[0].shape == (4, 20)
    assert not torch.allclose(out[0], out[1]) and not torch.allclose(out[1], out[2])


def test_a_warm_up_with_the_term_learns_to_rebuild_every_cell_and_returns_a_plain_net():
    cells, y, b = _cells()
    labels = np.where((b == 0) & (y < 3), y, -1)  # the second batch and one type unlabelled
    cfg = OrcaConfig(hidden_dims=(64, 32), epochs=8, warmup_epochs=4, progress=False)
    nets = {}
    for w in (0.0, 1.0):
        lab = FAST_LAB.replace(warmup_recon=w)
        plan = schedule(cells.shape[0], cfg, lab)
        nets[w], history = fit_warmup(cells, labels, 3, cfg, plan, TrainRandom(0, cells.device),
                                      lab=lab)  # fmt: skip
        assert not hasattr(nets[w], "decoder")  # the decoder does not outlive the warm-up
        rec = [h["regularizer"] for h in history]
        if w:  # the reconstruction (in the regulariser's column) falls epoch by epoch
            assert rec[-1] < 0.7 * rec[0]
        else:
            assert max(rec) == 0.0
    again, _ = fit_warmup(cells, labels, 3, cfg, plan, TrainRandom(0, cells.device), lab=lab)
    state, other = nets[1.0].state_dict(), nets[0.0].state_dict()
    assert set(state) == set(other)  # a model file of the usual keys
    assert all(torch.equal(state[k], again.state_dict()[k]) for k in state)  # same seed
    assert not torch.equal(state["head.weight"], other["head.weight"])


def test_the_term_reads_the_cells_of_the_labelled_batches_unless_told_all():
    cells, y, b = _cells()
    labels = np.where((b == 0) & (y < 3), y, -1)  # batch 1: a separate query
    cfg = OrcaConfig(hidden_dims=(64, 32), epochs=8, warmup_epochs=4, progress=False)
    labelled = set(np.flatnonzero(labels >= 0))
    for which, read in (("labelled_batches", (b == 0) & (labels < 0)), ("all", labels < 0)):
        lab = FAST_LAB.replace(warmup_recon=1.0, warmup_recon_cells=which)
        plan = schedule(cells.shape[0], cfg, lab)
        loss = OrcaLoss(cells, labels, cfg, plan, None, full=False, lab=lab)
        assert set(loss.unlabelled_rows) == set(np.flatnonzero(read))
        rand = TrainRandom(0, cells.device)
        epoch = CellBatches(cells, labels, plan, rand, False, None, loss.unlabelled_rows).epoch(0)
        assert set(np.concatenate(epoch)) == labelled | set(np.flatnonzero(read))
    # without the term a warm-up's batches hold the labelled cells alone
    plain = CellBatches(cells, labels, plan, TrainRandom(0, cells.device), False, None)
    assert set(np.concatenate(plain.epoch(0))) == labelled


def test_a_run_with_the_term_finds_the_hidden_type():
    ref, query = hidden_type_pair()
    lab = FAST_LAB.replace(warmup_recon=10.0)
    out = orca_sc.tl.annotate(query, ref, labels_key="cell_type", copy=True, seed=0,
                              **{**FAST, "ablation": lab})  # fmt: skip
    truth = query.obs["cell_type"].astype(str).to_numpy()
    novel = out.obs["orca_novel"].notna().to_numpy()
    assert novel[truth == "type_4"].mean() > 0.8 and novel[truth != "type_4"].mean() < 0.1


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [({"warmup_recon": -1.0}, "non-negative"), ({"warmup_recon": float("nan")}, "non-negative"),
     ({"warmup_recon": "ten"}, "non-negative"),
     ({"warmup_recon_cells": "query"}, '"labelled_batches" or "all"'),
     # the cluster term (tests/test_warmup_clusters.py), which takes the place of this one
     ({"warmup_clusters": -1.0}, "non-negative"), ({"warmup_clusters": "ten"}, "non-negative"),
     ({"warmup_clusters_space": "pca"}, '"batch", "joint", "harmony" or "mnn"'),
     ({"warmup_clusters": 1.0, "warmup_recon": 1.0}, "one extra warm-up term")],
)  # fmt: skip
def test_the_settings_are_checked_with_one_clear_error_each(bad, fragment):
    with pytest.raises(ConfigError) as err:
        Ablation(**bad)
    assert next(iter(bad)) in str(err.value) and fragment in str(err.value)
