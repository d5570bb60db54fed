"""Training on several processes (GPUs, machines) with PyTorch's ``torch.distributed``.

The processes are started by ``torchrun`` (``torchrun --nproc_per_node 4 -m orca_sc annotate
...``), never by orca_sc itself. Each process (rank) reads its own share of the cells from disk,
and every statistic the method takes over cells is summed over the ranks: the gene statistics of
the gene selection, the margin's mean uncertainty, the BatchNorm statistics, and the whole loss of
a mini-batch (the regulariser's mean prediction and the pairwise partners are taken over the
global mini-batch). One mini-batch of ``batch_size`` cells is split among the ranks, so that a run
on ``W`` ranks follows single-process training on the same mini-batches up to floating-point
rounding. Decisions (discovery, thresholds) are made on rank 0 and sent to the others.

:class:`Comm` is the handle; with one process all of its methods do nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def launched() -> bool:
    """Whether this process was started by ``torchrun`` with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def main_process() -> bool:
    """Whether this process writes results: rank 0 of a process group, or the only process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class Comm:
    """The processes of one run: one (``active`` false: every method is the identity) or a
    ``torch.distributed`` process group, which must be initialised (:func:`init_from_env`).
    """

    def __init__(self, group: Any = None) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.world = dist.get_world_size(group) if self.active else 1
        # where collective tensors live: NCCL moves CUDA tensors only
        backend = dist.get_backend(group) if self.active else "gloo"
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        # the loss's collectives run on a group of their own: DDP's gradient all-reduces are
        # asynchronous, and on one group the two kinds could be issued in different orders
        self.loss_group = _loss_group(group) if self.active else None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def batch_shard(self, n: int) -> BatchShard:
        """The ranks' shares of a global mini-batch of ``n`` cells (see :meth:`share`)."""
        return BatchShard(self, tuple(int(s) for s in np.diff(self.bounds(n))))

    def share(self, n: int) -> np.ndarray:
        """The positions among ``n`` that fall to this rank (contiguous; the ranks' shares
        differ in size by at most one).
        """
        lo, hi = self.bounds(n)[self.rank : self.rank + 2]
        return np.arange(lo, hi)

    def bounds(self, n: int) -> np.ndarray:
        """``(world + 1,)`` boundaries of the ranks' shares of ``n`` positions."""
        sizes = np.full(self.world, n // self.world)
        sizes[: n % self.world] += 1
        return np.concatenate([[0], np.cumsum(sizes)])

    # ------------------------------------------------------------------ numpy collectives
    def sum(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` summed over the ranks (same shape and dtype on every rank)."""
        if not self.active:
            return arr
        t = torch.as_tensor(np.ascontiguousarray(arr)).to(self.device)
        dist.all_reduce(t, group=self.group)
        return t.cpu().numpy()

    def gather_rows(self, arr: np.ndarray) -> np.ndarray:
        """The ranks' ``arr`` (this rank's rows ``(n_r, ...)``) stacked in rank order."""
        if not self.active:
            return arr
        sizes = self.sum(_onehot_count(arr.shape[0], self.rank, self.world))
        m = int(sizes.max())
        pad = np.zeros((m, *arr.shape[1:]), dtype=arr.dtype)
        pad[: arr.shape[0]] = arr
        t = torch.as_tensor(pad).to(self.device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.group)
        return np.concatenate([o[:s].cpu().numpy() for o, s in zip(out, sizes, strict=True)])

    def gather_objects(self, obj: Any) -> list:
        """``obj`` of every rank, in rank order (pickled)."""
        if not self.active:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0, group=self.group, device=self.device)
        return box[0]

    # ------------------------------------------------------------------ errors and decisions
    def agree(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on every rank; when it raises on any rank, every rank raises the first such
        error (in rank order) instead of the others waiting for it in a collective.
        """
        if not self.active:
            return fn()
        error, result = None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
        errors = self.gather_objects(_picklable(error))
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise error if error is not None and error is first else first
        return result

    def on_main(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` run on rank 0 only, its result (or its error) on every rank."""
        if not self.active:
            return fn(*args, **kwargs)
        result, error = None, None
        if self.main:
            try:
                result = fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                error = _picklable(e)
        result, error = self.broadcast((result, error))
        if error is not None:
            raise error
        return result


_LOSS_GROUPS: list = []  # (process group, its loss group)


def _loss_group(group: Any) -> Any:
    """The loss group of ``group`` (``None``: the default group), created once per process
    group (collectively, in the same order on every rank).
    """
    pg = group if group is not None else dist.group.WORLD
    for known, loss in _LOSS_GROUPS:
        if known is pg:
            return loss
    ranks = dist.get_process_group_ranks(pg)
    loss = dist.new_group(ranks=ranks, backend=dist.get_backend(pg))
    _LOSS_GROUPS.append((pg, loss))
    return loss


def _onehot_count(n: int, rank: int, world: int) -> np.ndarray:
    out = np.zeros(world, dtype=np.int64)
    out[rank] = n
    return out


def _picklable(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


def init_from_env(device: str) -> Comm:
    """The :class:`Comm` of this run: the process group already initialised by the caller, one
    set up here from ``torchrun``'s environment (NCCL when the run uses CUDA, else gloo), or a
    single process.
    """
    if dist.is_available() and not dist.is_initialized() and launched():
        cuda = device in ("auto", "cuda") and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank())
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        logger.info(
            "torch.distributed: rank %d of %d (%s).",
            dist.get_rank(),
            dist.get_world_size(),
            dist.get_backend(),
        )
    return Comm()


def rank_device(device: str, comm: Comm) -> str:
    """The device of this rank: under a multi-process run, ``"auto"`` and ``"cuda"`` mean this
    process's GPU (``cuda:LOCAL_RANK``).
    """
    if comm.active and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return device


# ---------------------------------------------------------------------------- autograd pieces
# The loss of a mini-batch is computed on every rank from the whole (gathered) batch, so it is
# the same number everywhere. The backward of each collective below sums the gradients of all
# ranks, so a rank's activations receive ``world`` times their true gradient; DDP averages the
# parameters' gradients over the ranks, which gives exactly the gradient of the batch loss.
class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        ctx.group = group
        return y

    @staticmethod
    def backward(ctx, grad):
        g = grad.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _GatherPadded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world, rank):  # (m, C) -> (world, m, C)
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x.contiguous(), group=group)
        ctx.group, ctx.rank = group, rank
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank], None, None, None


@dataclass(frozen=True)
class BatchShard:
    """The part of one global mini-batch that falls to this rank: rows ``lo : lo + sizes[rank]`` of ``total``."""

    comm: Comm
    sizes: tuple[int, ...]

    @property
    def total(self) -> int:
        return int(sum(self.sizes))

    @property
    def lo(self) -> int:
        return int(sum(self.sizes[: self.comm.rank]))

    @property
    def n(self) -> int:
        return self.sizes[self.comm.rank]

    @property
    def rows(self) -> slice:
        """The positions in the global batch that fall to this rank."""
        return slice(self.lo, self.lo + self.n)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, differentiably."""
        return _AllReduceSum.apply(x, self.comm.loss_group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' rows ``x`` ``(n, C)`` joined into the global batch ``(total, C)``,
        differentiably.
        """
        m = max(self.sizes)
        if x.shape[0] < m:
            x = torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])
        g = _GatherPadded.apply(x, self.comm.loss_group, self.comm.world, self.comm.rank)
        return torch.cat([g[r, :s] for r, s in enumerate(self.sizes)])


#: the part of the global mini-batch this rank is training on (set by the training engine)
_SHARD: contextvars.ContextVar[BatchShard | None] = contextvars.ContextVar("shard", default=None)


def active_shard() -> BatchShard | None:
    """The :class:`BatchShard` of the step being run, or ``None`` (one process, or not in a
    training step): layers whose result depends on the whole batch (dropout masks, BatchNorm
    statistics) read it instead of taking it as an argument.
    """
    return _SHARD.get()


@contextlib.contextmanager
def sharded(shard: BatchShard | None) -> Iterator[BatchShard | None]:
    """Run a training step on this rank's part ``shard`` of a global batch (``None``: the
    whole batch, as one process).
    """
    token = _SHARD.set(shard)
    try:
        yield shard
    finally:
        _SHARD.reset(token)
