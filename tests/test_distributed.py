"""Training with several processes (issue 22): two processes launched by ``torchrun`` with the
gloo backend on the CPU must follow single-process training on the same mini-batches. The
worker (``tests/ddp_worker.py``) runs both and reports what differs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from conftest import computed_once

import orca_sc
from orca_sc._dist import BatchShard, Comm

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def ddp_result(tmp_path_factory):
    """The worker's report, made once per session (:func:`conftest.computed_once`)."""
    return computed_once(tmp_path_factory, "ddp", _run_ddp_worker)


def _run_ddp_worker(tmp: Path) -> dict:
    a = orca_sc.datasets.simulate(2400, 800, 7, library_size=800, seed=1)
    a.obs["cell_type"] = a.obs["cell_type"].astype(str)
    in_ref = np.random.default_rng(0).random(a.n_obs) < 0.5
    novel = a.obs["cell_type"].isin(["type_5", "type_6"]).to_numpy()
    a[in_ref & ~novel].copy().write_h5ad(tmp / "ref.h5ad")
    a[~in_ref].copy().write_h5ad(tmp / "query.h5ad")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    worker = Path(__file__).with_name("ddp_worker.py")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(worker), str(tmp / "ref.h5ad"), str(tmp / "query.h5ad"), str(tmp / "out"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out" / "ddp.json").read_text())


def test_ranks_read_their_share_and_select_the_same_genes(ddp_result):
    """Each rank reads half of each backed file; the summed gene statistics select the genes
    one process selects, and the gathered matrix is the single process's, row for row.
    """
    assert ddp_result["world"] == 2
    assert ddp_result["same_genes"]
    assert ddp_result["matrix_max_diff"] == 0.0
    assert ddp_result["same_labels_prepared"]
    assert ddp_result["same_totals"]  # each cell's counts, for the Pearson residuals


def test_one_step_has_the_single_process_gradient(ddp_result):
    """The full objective on one mini-batch split over two ranks (synchronised BatchNorm,
    dropout masks of the whole batch, pairs and regulariser over the gathered batch, DDP's
    averaged gradients) gives the single-process loss and gradient up to rounding.
    """
    loss_d, loss_s = ddp_result["step_loss"]
    assert loss_d == pytest.approx(loss_s, rel=1e-6)
    assert ddp_result["step_grad_rel_diff"] < 1e-5
    assert ddp_result["step_running_stats_rel_diff"] < 1e-5
    # the sparse first layer (CPU, sparse data) with per-batch scale and offset: the same
    loss_d, loss_s = ddp_result["sparse_step_loss"]
    assert loss_d == pytest.approx(loss_s, rel=1e-6)
    assert ddp_result["sparse_step_grad_rel_diff"] < 1e-5
    assert ddp_result["sparse_vs_dense_grad_rel_diff"] < 1e-5


def test_a_rank_without_rows_of_the_batch_keeps_the_step_exact(ddp_result):
    """A 6-cell batch whose cells all fall to one rank (rank 0 or rank 1 with none: what a
    small last batch gives with more ranks than cells), dense and sparse layouts: the empty
    rank still takes part in every exchange, and loss, gradient and running statistics are the
    single process's.
    """
    steps = ddp_result["empty_rank_step"]
    assert sorted(steps) == ["dense_0", "dense_6", "sparse_0", "sparse_6"]
    for step in steps.values():
        loss_d, loss_s = step["loss"]
        assert loss_d == pytest.approx(loss_s, rel=1e-6)
        assert step["grad_rel_diff"] < 1e-5
        assert step["running_stats_rel_diff"] < 1e-5


def test_training_and_annotation_follow_single_process(ddp_result):
    """Over epochs the two runs drift only by rounding: same first-epoch loss, and the whole
    annotation (warm-up, discovery on rank 0, open-world fit) labels the cells alike.
    """
    d, s = ddp_result["warmup_loss_distributed"], ddp_result["warmup_loss_single"]
    assert d[0] == pytest.approx(s[0], rel=1e-5)
    assert np.allclose(d, s, rtol=1e-3)
    assert ddp_result["n_novel_distributed"] == ddp_result["n_novel_single"]
    assert ddp_result["label_agreement"] >= 0.98
    assert ddp_result["processes_recorded"] == 2


def test_single_process_comm_is_the_identity():
    """Without a process group every collective returns its input (the one-process path)."""
    comm = Comm()
    assert not comm.active and comm.world == 1 and comm.main
    x = np.arange(6.0).reshape(3, 2)
    assert comm.sum(x) is x
    assert comm.gather_rows(x) is x
    assert comm.broadcast({"a": 1}) == {"a": 1}
    assert comm.on_main(lambda: 7) == 7
    assert list(comm.share(5)) == [0, 1, 2, 3, 4]
    shard = BatchShard(comm, (5,))
    assert (shard.total, shard.lo, shard.n) == (5, 0, 5)


def test_shares_cover_every_row_once():
    comm = Comm()
    comm.world = 3  # the boundaries are arithmetic on (world, n)
    for n in (0, 1, 2, 7, 512):
        b = comm.bounds(n)
        assert b[0] == 0 and b[-1] == n
        assert np.all(np.diff(b) >= 0) and np.ptp(np.diff(b)) <= 1


def _torchrun(args, tmp_path, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "orca_sc", *args,
    ]  # fmt: skip
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )


def test_cli_under_torchrun_writes_once_and_reports_errors_once(tmp_path):
    """``torchrun ... -m orca_sc annotate --on-disk``: rank 0 writes the annotated file and the
    summary; bad input gives one error message (not one per rank) and a non-zero exit.
    """
    import anndata as ad

    a = orca_sc.datasets.simulate(900, 400, 5, library_size=800, seed=2)
    a.obs["cell_type"] = a.obs["cell_type"].astype(str)
    ref, query = a[:450], a[450:]
    ref[ref.obs["cell_type"] != "type_4"].copy().write_h5ad(tmp_path / "ref.h5ad")
    query.copy().write_h5ad(tmp_path / "query.h5ad")
    common = ["annotate", "ref.h5ad", "query.h5ad", "--epochs", "4"]
    proc = _torchrun(
        [*common, "--labels-key", "cell_type", "-o", "out.h5ad", "--on-disk"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Annotated 450 cells") == 1
    out = ad.read_h5ad(tmp_path / "out.h5ad")
    assert out.obs["orca_label"].notna().all()
    assert out.uns["orca"]["training"]["processes"] == 2
    assert not list(tmp_path.glob(".*orca-tmp*"))  # no rank left a temporary file

    bad = _torchrun([*common, "--labels-key", "no_such_column", "-o", "bad.h5ad"], tmp_path)
    assert bad.returncode != 0
    assert bad.stderr.count("no_such_column") == 1, bad.stderr[-2000:]
    assert not (tmp_path / "bad.h5ad").exists()


def test_predict_refuses_torchrun(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from orca_sc.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    res = CliRunner().invoke(main, ["predict", "model.pt", "query.h5ad"])
    assert res.exit_code != 0
    assert "without torchrun" in res.output
