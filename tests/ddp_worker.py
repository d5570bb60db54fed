"""Run under ``torchrun --nproc_per_node 2`` by ``tests/test_distributed.py`` (and usable by
hand): trains with several processes, then, on rank 0 alone, trains the same thing as one
process, and writes what differs to ``OUT/ddp.json``.

Usage: ``torchrun --standalone --nproc_per_node 2 tests/ddp_worker.py REF.h5ad QUERY.h5ad OUT``
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import orca_sc
from orca_sc._ablation import Ablation
from orca_sc._cells import CellMatrix
from orca_sc._config import OrcaConfig
from orca_sc._data import prepare
from orca_sc._dist import BatchShard, Comm, init_from_env
from orca_sc._model import train
from orca_sc._train import TrainRandom, fit_warmup, schedule

#: the schedule of the epochs given, without the floor of steps of small data
NO_FLOOR = Ablation(epoch_min_steps=0)


def _training(data, cfg, comm):
    """Two epochs of the supervised warm-up, as one process or as ``comm``'s ranks."""
    shape = (len(data.domain_names), data.X.shape[1])
    cells = CellMatrix(data.X, data.domain, np.ones(shape), np.zeros(shape), torch.device("cpu"))
    plan = schedule(data.n_cells, cfg, NO_FLOOR)
    net, hist = fit_warmup(
        cells, data.labels, len(data.classes), cfg, plan, TrainRandom(cfg.seed, cells.device), comm
    )
    return net.state_dict(), [h["loss"] for h in hist], plan.steps_per_epoch


def _one_step(data, cfg, comm, layout="dense", n=300, sizes=None):
    """The gradient of the full objective on one mini-batch of ``n`` cells (labelled and not),
    and the BatchNorm running statistics after it; the batches' scale and offset are not the
    identity, so that the sparse layout's offset term takes part. ``sizes``: the ranks' shares
    of the batch (default: as the trainer splits it), e.g. ``(0, n)`` for a rank with no rows.
    """
    from torch.nn.parallel import DistributedDataParallel

    from orca_sc._dist import sharded
    from orca_sc._loss import orca_loss_terms
    from orca_sc.module import OrcaNet

    shape = (len(data.domain_names), data.X.shape[1])
    rng = np.random.default_rng(5)
    scale, offset = rng.uniform(0.8, 1.2, shape), rng.normal(0, 0.1, shape)
    cells = CellMatrix(data.X, data.domain, scale, offset, torch.device("cpu"), layout=layout)
    torch.manual_seed(0)
    net = OrcaNet(data.X.shape[1], len(data.classes) + 2, cfg.hidden_dims, cfg.dropout)
    batch = np.random.default_rng(0).choice(data.n_cells, n, replace=False)
    y = torch.as_tensor(data.labels[batch])
    model, shard, rows = net, None, batch
    if comm is not None:
        model = DistributedDataParallel(net, process_group=comm.group)
        shard = comm.batch_shard(batch.size) if sizes is None else BatchShard(comm, sizes)
        rows = batch[shard.rows]
    net.train()
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(2)
    with sharded(shard):  # as the training engine runs a step
        loss = orca_loss_terms(model, cells.batch(rows), y, 0.2, NO_FLOOR, gen, full=True)
        loss[0].backward()
    grads = {k: p.grad.detach().clone() for k, p in net.named_parameters()}
    stats = {k: v.detach().clone() for k, v in net.state_dict().items() if "running" in k}
    return float(loss[0].detach()), grads, stats


def _step_diff(step_d, step_s):
    """A distributed step against the single process's: both losses, and the relative
    differences of the gradient and of the running statistics.
    """
    return {
        "loss": [step_d[0], step_s[0]],
        "grad_rel_diff": _rel(step_d[1], step_s[1]),
        "running_stats_rel_diff": _rel(step_d[2], step_s[2]),
    }


def _rel(a: dict, b: dict) -> float:
    """Largest difference over the tensors of ``a`` and ``b``, relative to their largest value
    (per tensor it would not do: the biases before a BatchNorm have a gradient of zero, which
    both runs compute as rounding noise of 1e-8).
    """
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    return diff / max(float(b[k].abs().max()) for k in b)


def main(ref_path: str, query_path: str, out: str) -> None:
    torch.set_num_threads(1)
    comm = init_from_env("cpu")
    cfg = OrcaConfig(
        device="cpu", epochs=6, warmup_epochs=2, n_genes=300, progress=False,
        batch_size=256,
    )  # fmt: skip
    ref = orca_sc.read_lazy(ref_path, "Reference")
    query = orca_sc.read_lazy(query_path, "Query")
    t0 = time.perf_counter()
    data = prepare(query, ref, "cell_type", cfg, comm)  # each rank reads its share
    t_prep = time.perf_counter() - t0
    step_d = _one_step(data, cfg, comm)
    sparse_d = _one_step(data, cfg, comm, "sparse")
    # a rank with no rows of the batch (more ranks than cells in a small last batch)
    empty_d = {
        f"{layout}_{k}": _one_step(data, cfg, comm, layout, n=6, sizes=(k, 6 - k))
        for layout in ("dense", "sparse")
        for k in (0, 6)
    }
    t0 = time.perf_counter()
    state_d, loss_d, steps = _training(data, cfg, comm)
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, ann_d = train(query, ref, "cell_type", cfg, NO_FLOOR)
    t_fit = time.perf_counter() - t0
    world = comm.world
    dist.barrier()
    dist.destroy_process_group()
    if comm.rank != 0:
        return
    os.environ["WORLD_SIZE"] = "1"  # no longer a torchrun process group
    # the same as one process (the process group is gone: Comm is inactive)
    single = Comm()
    assert not single.active
    data_s = prepare(query, ref, "cell_type", cfg, single)
    step_s = _one_step(data_s, cfg, None)
    sparse_s = _one_step(data_s, cfg, None, "sparse")
    empty_s = {layout: _one_step(data_s, cfg, None, layout, n=6) for layout in ("dense", "sparse")}
    state_s, loss_s, _ = _training(data_s, cfg, None)
    t0 = time.perf_counter()
    _, ann_s = train(query, ref, "cell_type", cfg, NO_FLOOR)
    t_fit_s = time.perf_counter() - t0
    param_diff = {
        k: float((state_d[k].double() - state_s[k].double()).abs().max()) for k in state_s
    }
    result = {
        "world": world,
        "same_genes": data.genes == data_s.genes,
        "matrix_max_diff": float(abs(data.X - data_s.X).max()),
        "same_labels_prepared": bool(np.array_equal(data.labels, data_s.labels)),
        "same_totals": bool(np.array_equal(data.totals, data_s.totals))
        and bool(np.isfinite(data.totals).all()),
        "step_loss": [step_d[0], step_s[0]],
        "step_grad_rel_diff": _rel(step_d[1], step_s[1]),
        "step_grad_per_param": {
            k: [
                float((step_d[1][k] - step_s[1][k]).abs().max()),
                float(step_s[1][k].abs().max()),
                float(step_d[1][k].abs().max()),
            ]
            for k in step_s[1]
        },
        "step_running_stats_rel_diff": _rel(step_d[2], step_s[2]),
        "sparse_step_loss": [sparse_d[0], sparse_s[0]],
        "sparse_step_grad_rel_diff": _rel(sparse_d[1], sparse_s[1]),
        "sparse_vs_dense_grad_rel_diff": _rel(sparse_s[1], step_s[1]),
        "empty_rank_step": {k: _step_diff(d, empty_s[k.split("_")[0]]) for k, d in empty_d.items()},
        "warmup_steps_per_epoch": steps,
        "warmup_loss_distributed": loss_d,
        "warmup_loss_single": loss_s,
        "warmup_param_max_diff": max(param_diff.values()),
        "label_agreement": float(np.mean(ann_d.labels == ann_s.labels)),
        "n_novel_distributed": len(ann_d.novel_names),
        "n_novel_single": len(ann_s.novel_names),
        "embedding_max_diff": float(np.abs(ann_d.embedding - ann_s.embedding).max()),
        "processes_recorded": ann_d.record.training["processes"],
        "seconds": {"prepare": t_prep, "warmup": t_train, "fit": t_fit, "fit_single": t_fit_s},
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "ddp.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:4])
