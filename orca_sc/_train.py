"""ORCA's training (paper Algorithm 1) in two phases, and batched inference. Torch and numpy
only: no AnnData, nothing of ``tl``.

:func:`fit_warmup` trains a new net on the labelled cells (supervised term only);
:func:`fit_open_world` continues from it with novel heads added (a new net) and the full
objective on all cells. A :class:`TrainRandom` carries the random streams across the two.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from ._ablation import LAB, MAX_MARGIN, Ablation
from ._align import aligned_rows
from ._config import OrcaConfig
from ._dist import BatchShard, Comm, active_shard
from ._engine import StopState, fit_phase, stage
from ._errors import ConfigError
from .module import (
    OrcaNet,
    SparseRows,
    adaptive_margin,
    joint_cosine_features,
    margin_cross_entropy,
    masked_margin_cross_entropy,
    orca_objective,
    split_cosine_similarity,
)

logger = logging.getLogger(__name__)

_INFER_CHUNK = 8192


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA if available, else MPS, else CPU; explicit requests are checked."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= n:
            have = f"{n} CUDA GPU(s)" if n else "no CUDA GPU"
            raise ConfigError("device", device, f"'cpu' or 'auto': this machine has {have}")
    if device == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError("device", device, "'cpu' or 'auto': MPS is not available here")
    return torch.device(device)


#: cuBLAS workspace that makes its products bitwise reproducible (NVIDIA's documented setting);
#: read when cuBLAS starts in the process, so set before the first product on the GPU
_CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def reproducible(device: torch.device | str):
    """Same seed, same device, same result on a GPU too: on CUDA, torch's deterministic
    algorithms for the duration (scatter-adds, index-adds and the sparse first layer's gradient
    otherwise sum in whatever order the GPU's threads finish, so two runs of 20,000 cells gave
    different embeddings), with a warning, not an error, for an operation that has none; the
    caller's setting is restored on leaving. Nothing changes on the CPU, whose kernels are
    deterministic already.
    """
    if torch.device(device).type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def reproducibly(fn):
    """:func:`reproducible` around ``fn``, on the device its ``device`` argument names."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        device = bound.arguments.get("device") or "auto"
        with reproducible(device if isinstance(device, torch.device) else resolve_device(device)):
            return fn(*args, **kwargs)

    return wrapper


#: the first layer reads the mini-batch as a sparse matrix when the training matrix holds at
#: most this share of non-zeros (CPU only). Measured on 2 CPU threads, 512 cells x 2,000 genes:
#: the first layer's forward + weight gradient takes 12.8 ms dense and 6.3 ms sparse at 5.6%
#: non-zeros (real data after gene selection: 1-7%), 8.0 ms at 10%, and 42 ms at 40% (the
#: default simulator), so sparse pays below about 20%.
SPARSE_MAX_DENSITY = 0.2
#: on a GPU the whole aligned matrix is kept dense on the device when it takes at most this
#: share of the device's memory (the training step is then one gather, no host work)
RESIDENT_MAX_FRACTION = 0.4
#: the layouts of :class:`CellMatrix` per device type (others: ``"device-csr"``)
_LAYOUTS = {"cpu": ("sparse", "dense"), "cuda": ("resident", "device-csr")}


def _csr_tensor(m: sp.csr_matrix) -> torch.Tensor:
    with warnings.catch_warnings():  # torch's note that sparse CSR tensors are a beta feature
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(
            torch.from_numpy(m.indptr.astype(np.int64)),
            torch.from_numpy(m.indices.astype(np.int64)),
            torch.from_numpy(m.data),
            size=m.shape,
            check_invariants=False,
        )


class CellMatrix:
    """The aligned training matrix (``X * scale[domain] + offset[domain]``, never built in full
    on the host) and how mini-batches reach the first layer (``layout``):

    - ``"resident"`` (a GPU with room for it: at most :data:`RESIDENT_MAX_FRACTION` of its
      memory): the whole aligned matrix dense on the device, built chunk by chunk; a batch is one
      gather on the device.
    - ``"device-csr"`` (a GPU without that room): the CSR arrays on the device, a batch is
      densified there by index arithmetic.
    - ``"sparse"`` (CPU, at most :data:`SPARSE_MAX_DENSITY` non-zeros): a batch is a sparse
      matrix and the first layer a sparse product.
    - ``"dense"`` (CPU, denser data): a batch is sliced from the host CSR and densified.

    On the CPU the caller's CSR arrays are used as they are (no copy of the matrix).
    The layout depends only on the data and the device, so the same seed on the same device
    gives the same result.
    """

    def __init__(
        self,
        X: sp.csr_matrix,
        domain: np.ndarray,
        scale: np.ndarray,
        offset: np.ndarray,
        device: torch.device,
        layout: str = "auto",
    ) -> None:
        X = sp.csr_matrix(X)
        if X.dtype != np.float32:
            X = X.astype(np.float32)
        self.X = X
        self.shape = X.shape
        self.density = X.nnz / max(1, X.shape[0] * X.shape[1])  # share of non-zeros
        self.device = device
        self.domain_np = np.asarray(domain, dtype=np.int64)
        self.scale_np = np.asarray(scale, dtype=np.float32)
        self.offset_np = np.asarray(offset, dtype=np.float32)
        self.has_scale = not bool(np.all(self.scale_np == 1))
        self.has_offset = bool(np.any(self.offset_np != 0))
        self.domain = torch.as_tensor(self.domain_np, device=device)
        self.scale = torch.as_tensor(self.scale_np, device=device)
        self.offset = torch.as_tensor(self.offset_np, device=device)
        self.layout = self._layout(layout)
        if self.layout == "resident":
            self._build_resident()
        elif self.layout == "device-csr":
            self.counts = np.diff(X.indptr)
            self.indptr = torch.as_tensor(X.indptr.astype(np.int64), device=device)
            self.indices = torch.as_tensor(X.indices.astype(np.int64), device=device)
            self.data = torch.as_tensor(X.data, device=device)

    def _layout(self, layout: str) -> str:
        kind = self.device.type
        if layout != "auto":
            allowed = _LAYOUTS.get(kind, ("device-csr",))
            if layout not in allowed:
                raise ConfigError("layout", layout, f"one of {allowed} on {kind}")
            return layout
        if kind == "cpu":
            return "sparse" if self.density <= SPARSE_MAX_DENSITY else "dense"
        if kind == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            need = self.shape[0] * self.shape[1] * 4
            return "resident" if need <= RESIDENT_MAX_FRACTION * total else "device-csr"
        return "device-csr"  # MPS and others: the portable path

    def _build_resident(self) -> None:
        n, g = self.shape
        self.dense = torch.empty((n, g), dtype=torch.float32, device=self.device)
        step = max(1, (1 << 26) // max(g, 1))  # 256 MiB of float32 per chunk
        for start in range(0, n, step):
            stop = min(n, start + step)
            rows = np.arange(start, stop)
            self.dense[start:stop] = torch.as_tensor(self._aligned(rows), device=self.device)

    def _aligned(self, rows: np.ndarray) -> np.ndarray:
        """The rows ``rows`` dense and aligned, on the host."""
        if self.has_scale or self.has_offset:
            return aligned_rows(self.X, self.domain_np, self.scale_np, self.offset_np, rows)
        return self.X[rows].toarray()

    def to_device(self, idx: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(idx, device=self.device)

    def batch(self, idx: np.ndarray, idx_t: torch.Tensor | None = None):
        """The rows ``idx`` (host indices; ``idx_t``: the same on the device, if already there)
        in the form the first layer takes: a dense ``(len(idx), G)`` tensor or
        :class:`SparseRows`. Never waits on the device.
        """
        if len(idx) == 0:  # a rank's empty part of a small global batch
            return torch.zeros((0, self.shape[1]), device=self.device)
        if self.layout == "sparse":
            return self._sparse_rows(idx)
        if self.layout == "dense":
            return torch.from_numpy(self._aligned(idx))
        if idx_t is None:
            idx_t = self.to_device(idx)
        if self.layout == "resident":
            return self.dense[idx_t]
        total = int(self.counts[idx].sum())  # known on the host: no wait on the device
        start = self.indptr[idx_t]
        counts = self.indptr[idx_t + 1] - start  # (B,)
        out = torch.zeros((idx_t.shape[0], self.shape[1]), device=self.device)
        if total:
            row_of = torch.repeat_interleave(
                torch.arange(idx_t.shape[0], device=self.device), counts, output_size=total
            )
            # position of each gathered entry inside its row, then its global position in data
            first = torch.cumsum(counts, 0) - counts
            pos = torch.arange(total, device=self.device) - first[row_of] + start[row_of]
            out[row_of, self.indices[pos]] = self.data[pos]
        if self.has_scale or self.has_offset:
            d = self.domain[idx_t]
            out = out * self.scale[d] + self.offset[d]
        return out

    def _sparse_rows(self, idx: np.ndarray) -> SparseRows:
        m = self.X[idx]
        d = self.domain_np[idx]
        if self.has_scale:
            m.data = m.data * self.scale_np[np.repeat(d, np.diff(m.indptr)), m.indices]
        member = np.eye(self.offset_np.shape[0], dtype=np.float32)[d]
        # the transpose serves the weight gradient alone: inference (no grad) goes without
        return SparseRows(
            _csr_tensor(m),
            _csr_tensor(m.T.tocsr()) if torch.is_grad_enabled() else None,
            torch.from_numpy(member),
            self.offset if self.has_offset else None,
        )


#: the most memory the margin's kept batches may hold (otherwise they are built at each refresh)
UNCERTAINTY_BATCH_BYTES = 256 << 20


def _affordable(data: CellMatrix, n_rows: int) -> bool:
    """Whether ``n_rows`` rows of ``data`` in batch form fit :data:`UNCERTAINTY_BATCH_BYTES`
    (dense rows: 4 bytes a value; sparse ones: about 12 a stored value).
    """
    per_value = 12 * data.density if data.layout == "sparse" else 4
    return n_rows * data.shape[1] * per_value <= UNCERTAINTY_BATCH_BYTES


@torch.no_grad()
def uncertainty_batches(data: CellMatrix, rows: np.ndarray, comm: Comm | None = None) -> list:
    """The batches :func:`mean_uncertainty` reads for ``rows`` (this rank's share of them), built
    once for a phase: the rows are fixed, so every epoch's refresh reads the same batches.
    """
    mine = rows if comm is None else rows[comm.share(rows.size)]
    return [data.batch(mine[lo : lo + _INFER_CHUNK]) for lo in range(0, mine.size, _INFER_CHUNK)]


@torch.no_grad()
def mean_uncertainty(
    net: OrcaNet,
    data: CellMatrix,
    rows: np.ndarray,
    comm: Comm | None = None,
    batches: list | None = None,
) -> float:
    """Paper Eq. 4: mean over ``rows`` of ``1 - max softmax``, in eval mode (each rank of
    ``comm`` takes its share of ``rows``; the sum is taken over the ranks). ``batches``: those of
    :func:`uncertainty_batches` for the same rows, where the caller keeps them.
    """
    if rows.size == 0:
        return 0.0
    net.eval()
    if batches is None:
        batches = uncertainty_batches(data, rows, comm)
    total = torch.zeros((), device=data.device)
    for x in batches:
        logits, _ = net(x)
        total += (1 - F.softmax(logits, dim=1).amax(dim=1)).sum()
    if comm is not None:
        total = float(comm.sum(np.array([float(total)]))[0])
    return float(total) / rows.size


@dataclass(frozen=True)
class Schedule:
    """Batches per epoch and the number of epochs of each phase (see :func:`schedule`)."""

    steps_per_epoch: int
    n_epochs: int
    warmup: int
    anchor: int


def schedule(n_cells: int, config: OrcaConfig, lab: Ablation = LAB) -> Schedule:
    """At least ``lab.epoch_min_steps`` optimiser steps per epoch of ``config.epochs`` (passes
    over the cells are added for small data, so that a run of fewer epochs is always shorter);
    warm-up and anchor phases scale with the number of passes.
    """
    steps_per_epoch = max(1, math.ceil(n_cells / config.batch_size))
    min_steps = lab.epoch_min_steps * config.epochs
    n_epochs = max(config.epochs, math.ceil(min_steps / steps_per_epoch))
    warmup = round(config.warmup_epochs * n_epochs / config.epochs)
    anchor = round(lab.anchor_epochs * n_epochs / config.epochs)
    return Schedule(steps_per_epoch, n_epochs, warmup, anchor)


@dataclass(frozen=True)
class StopRule:
    """When a phase of training ends before its schedule (the schedule is the upper bound).

    Every ``every`` optimiser steps the phase is checked on a fixed ``sample`` of cells (rows of
    the training matrix): it stops at a check, once it has run ``min_steps`` steps, when both

    * the mean loss of the last ``every`` steps fell by less than two standard errors of the
      difference from the ``every`` steps before (the loss has stopped falling beyond its noise),
      and
    * the share of the sampled cells whose head (argmax, in eval mode) changed since the previous
      check is below ``tolerance``, or has stopped falling: it fell by less than two binomial
      standard errors of the difference from the check before. Cells between two close types
      keep changing head at a steady rate however long a phase trains (on noisy data 10% of
      the cells between warm-up checks); that rate no longer falling is the sign of convergence.
    """

    sample: np.ndarray
    tolerance: float
    every: int
    min_steps: int


#: cells whose heads a stopping check compares (a share of 1% is then 20 cells)
STOP_SAMPLE = 2000


def stop_rule(n_cells: int, config: OrcaConfig, lab: Ablation = LAB) -> StopRule | None:
    """The :class:`StopRule` of a phase (``None`` with ``lab.stop_tolerance=0``: the schedule).
    The sample is drawn from the config's seed, the same in both phases; the checks are
    ``lab.stop_check_steps`` steps apart (checks an epoch apart at any size were measured and
    not kept: they train longer at large sizes, docs/discovery.md).
    """
    if lab.stop_tolerance <= 0:
        return None
    rng = np.random.default_rng([config.seed, 0x5709])
    sample = np.sort(rng.choice(n_cells, size=min(n_cells, STOP_SAMPLE), replace=False))
    return StopRule(sample, lab.stop_tolerance, lab.stop_check_steps, lab.stop_min_steps)


def stop_state(rule: StopRule | None, data: CellMatrix, comm: Comm | None) -> StopState:
    """The engine's :class:`~orca_sc._engine.StopState` of ``rule`` over one phase on ``data``
    (``None``: one that never checks).
    """
    if rule is None:
        return StopState.never()

    def heads_of(net: OrcaNet) -> np.ndarray:
        return infer(net, data, rule.sample, comm)[0].argmax(axis=1)

    return StopState(rule.every, rule.min_steps, rule.tolerance, heads_of)


class TrainRandom:
    """The random streams of one training run, carried from the warm-up to the open-world phase
    so that the two phases together draw exactly as one run would: mini-batch order (numpy),
    labelled cells' pair partners (a torch generator) and torch's global stream (weight
    initialisation, dropout), which is saved on leaving a phase and restored on entering the next
    (the caller's global state is left as it was).
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.numpy = np.random.default_rng(seed)
        # on a GPU drawn there (no copy from the host per step); on the CPU as before
        gen_device = device if device.type == "cuda" else torch.device("cpu")
        self.pairs = torch.Generator(device=gen_device).manual_seed(seed)
        self._devices = [device] if device.type == "cuda" else []
        self._state: tuple | None = None
        self._seed = seed

    @contextlib.contextmanager
    def torch_stream(self):
        with torch.random.fork_rng(devices=self._devices):
            if self._state is None:
                torch.manual_seed(self._seed)
            else:
                torch.random.set_rng_state(self._state[0])
                if self._devices:
                    torch.cuda.set_rng_state(self._state[1], self._devices[0])
            try:
                yield
            finally:
                cuda = torch.cuda.get_rng_state(self._devices[0]) if self._devices else None
                self._state = (torch.random.get_rng_state(), cuda)


@dataclass(frozen=True)
class NovelHeads:
    """What the open-world phase needs from discovery: initial weights ``(k, D)`` of the novel
    heads, the regulariser's prior over all heads (``None``: uniform), and the rows of the
    training matrix anchored to a novel head during the anchor epochs, with their heads.
    """

    prototypes: np.ndarray
    prior: np.ndarray | None = None
    anchor_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    anchor_heads: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


def fit_warmup(
    data: CellMatrix,
    labels: np.ndarray,
    n_seen: int,
    config: OrcaConfig,
    plan: Schedule,
    rand: TrainRandom,
    comm: Comm | None = None,
    lab: Ablation = LAB,
) -> tuple[OrcaNet, list[dict]]:
    """A new :class:`OrcaNet` with one head per seen class, trained for at most ``plan.warmup``
    epochs on the labelled cells with the supervised term alone (the margin follows the
    unlabelled cells' uncertainty as in the full objective), stopped earlier by
    ``config``'s :class:`StopRule`. Returns the net and one history record per epoch.
    ``comm``: the processes that train it together (see :mod:`orca_sc._dist`).
    """
    with rand.torch_stream():
        net = OrcaNet(data.shape[1], n_seen, config.hidden_dims, config.dropout).to(data.device)
        loss = OrcaLoss(data, labels, config, plan, comm, full=False, generator=rand.pairs,
                        lab=lab)  # fmt: skip
        history = _fit(net, loss, data, labels, range(plan.warmup), plan, config, rand, comm)
    return net, history


def fit_open_world(
    net: OrcaNet,
    data: CellMatrix,
    labels: np.ndarray,
    novel: NovelHeads,
    config: OrcaConfig,
    plan: Schedule,
    rand: TrainRandom,
    pair_features: np.ndarray | None = None,
    comm: Comm | None = None,
    pair_fixed_only: np.ndarray | None = None,
    lab: Ablation = LAB,
) -> tuple[OrcaNet, list[dict]]:
    """ORCA's open-world phase (paper Algorithm 1) on all cells: a new net with ``net``'s
    backbone and seen heads plus the novel heads of ``novel``, trained with the full objective
    for at most the epochs after the warm-up (the first ``plan.anchor`` of them with the anchor
    term), stopped earlier by ``config``'s :class:`StopRule` (not during the anchor epochs).
    ``pair_features`` ``(n_cells, P)``: a fixed space in which unlabelled cells' pairwise
    partners are also looked for (``lab.pair_space``); ``pair_fixed_only`` ``(n_cells,)``:
    the cells that look for them in that space alone (``pair_space="query_pca"``: the cells of
    batches without labelled cells). ``net`` is left as it is.
    """
    dev = data.device
    with rand.torch_stream():
        net = net.with_novel_heads(torch.as_tensor(novel.prototypes, dtype=torch.float32))
        net = net.to(dev)
        prior = None
        if lab.prior == "data" and novel.prior is not None:
            prior = torch.as_tensor(novel.prior, dtype=torch.float32, device=dev)
        y_anchor = None
        if novel.anchor_rows.size:
            y_anchor = torch.full((data.shape[0],), -1, dtype=torch.int64, device=dev)
            y_anchor[torch.as_tensor(novel.anchor_rows, device=dev)] = torch.as_tensor(
                novel.anchor_heads, dtype=torch.int64, device=dev
            )
        feats = fixed_only = None
        if pair_features is not None:
            feats = torch.as_tensor(pair_features, dtype=torch.float32, device=dev)
        if pair_fixed_only is not None:
            fixed_only = torch.as_tensor(pair_fixed_only, dtype=torch.bool, device=dev)
        loss = OrcaLoss(
            data, labels, config, plan, comm, full=True, prior=prior, y_anchor=y_anchor,
            pair_features=feats, generator=rand.pairs, pair_fixed_only=fixed_only, lab=lab,
        )  # fmt: skip
        epochs = range(plan.warmup, plan.n_epochs)
        history = _fit(net, loss, data, labels, epochs, plan, config, rand, comm)
    net.eval()
    return net, history


def _fit(net, loss, data, labels, epochs, plan, config, rand, comm) -> list[dict]:
    """:func:`orca_sc._engine.fit_phase` of ``net`` on the cells of ``data``: the phase's
    batches, Adam, the stopping rule of ``config`` and, with several processes, the net
    wrapped for ``DistributedDataParallel``.
    """
    comm = comm if comm is not None and comm.active else None
    full = loss.full
    phase = "open-world" if full else "warm-up"
    rule = stop_rule(data.shape[0], config, loss.lab)
    return fit_phase(
        net, loss, CellBatches(data, labels, plan, rand, full, comm), _adam(net, config), epochs,
        phase=phase, stop=stop_state(rule, data, comm),
        model=_distributed(net, data.device, comm),
        desc="ORCA" if full else "ORCA warm-up", progress=config.progress,
    )  # fmt: skip


@dataclass(frozen=True)
class CellBatch:
    """One mini-batch of cells: the model's input ``x`` (this rank's rows), the batch's rows
    of the training matrix on the device ``rows``, and this rank's ``shard`` (``None``: one
    process).
    """

    x: torch.Tensor | SparseRows
    rows: torch.Tensor
    shard: BatchShard | None


class CellBatches:
    """The mini-batches of a phase on the cells of ``data``: every epoch a permutation of the
    labelled cells and one of the unlabelled, cut into ``plan.steps_per_epoch`` batches that mix
    the two in proportion (the warm-up's, ``full=False``, hold the labelled cells alone);
    balanced sizes, so that the last batch is never tiny. With several processes every rank
    draws the same batches and loads its part of each.
    """

    def __init__(self, data, labels, plan: Schedule, rand: TrainRandom, full: bool, comm):
        self.data, self.plan, self.rand, self.full, self.comm = data, plan, rand, full, comm
        self.lab_idx = np.flatnonzero(labels >= 0)
        self.unl_idx = np.flatnonzero(labels < 0)

    def epoch(self, epoch: int) -> list[np.ndarray]:
        rng, n = self.rand.numpy, self.plan.steps_per_epoch
        lab_chunks = np.array_split(rng.permutation(self.lab_idx), n)
        unl_chunks = np.array_split(rng.permutation(self.unl_idx), n)
        batches = [
            np.concatenate([lc, uc]) if self.full else lc
            for lc, uc in zip(lab_chunks, unl_chunks, strict=True)
        ]
        return [b for b in batches if b.size >= 2]

    def load(self, batches: list[np.ndarray]) -> Iterator[CellBatch]:
        data = self.data
        order = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
        order_t = data.to_device(order)  # one copy per stretch
        bounds = np.cumsum([0] + [b.size for b in batches])
        for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            idx = order_t[lo:hi]
            if self.comm is None:
                yield CellBatch(data.batch(batches[b], idx), idx, None)
            else:  # this rank's part of the batch
                shard = self.comm.batch_shard(hi - lo)
                yield CellBatch(data.batch(batches[b][shard.rows], idx[shard.rows]), idx, shard)


class OrcaLoss:
    """ORCA's objective on the cells of ``data`` (paper Eq. 1; :func:`orca_loss_terms`), with
    the state it keeps over a phase: the margin, set at the start of every epoch from the
    unlabelled cells' mean uncertainty (Eq. 4, over a fixed sample of at most
    :data:`UNCERTAINTY_CELLS`); the regulariser's ``prior``; the anchored cells' heads
    ``y_anchor`` (``(n_cells,)``, ``-1``: not anchored; used in the first ``plan.anchor``
    epochs after the warm-up, which the stopping rule never cuts); the fixed
    ``pair_features`` ``(n_cells, P)`` and the cells that look for partners in it alone,
    ``pair_fixed_only`` ``(n_cells,)``; the labelled cells' pair partners drawn from
    ``generator``. ``full=False``: the warm-up's supervised term alone.
    """

    terms = ("loss", "supervised", "pairwise", "regularizer", "anchor")

    def __init__(
        self, data: CellMatrix, labels: np.ndarray, config: OrcaConfig, plan: Schedule, comm,
        *, full: bool, prior=None, y_anchor=None, pair_features=None, generator=None,
        pair_fixed_only=None, lab: Ablation = LAB,
    ) -> None:  # fmt: skip
        self.data, self.config, self.plan, self.full = data, config, plan, full
        self.lab = lab
        self.comm = comm if comm is not None and comm.active else None
        self.y_all = torch.as_tensor(labels, device=data.device)
        self.u_rows = _uncertainty_rows(np.flatnonzero(labels < 0), config.seed)
        self.prior, self.y_anchor, self.pair_features = prior, y_anchor, pair_features
        self.generator, self.pair_fixed_only = generator, pair_fixed_only
        self.margin, self.anchored = 0.0, False
        self._u_batches: list | None = None  # built at the first refresh, read at every one

    def start_epoch(self, net: OrcaNet, epoch: int) -> dict:
        lab = self.lab
        with stage("margin refresh"):
            if self._u_batches is None and _affordable(self.data, self.u_rows.size):
                self._u_batches = uncertainty_batches(self.data, self.u_rows, self.comm)
            u = mean_uncertainty(net, self.data, self.u_rows, self.comm, self._u_batches)
        self.margin = adaptive_margin(lab.margin, u, lab.lam, MAX_MARGIN, lab.fixed_margin)
        plan = self.plan
        self.anchored = self.y_anchor is not None and epoch < plan.warmup + plan.anchor
        return {"uncertainty": u, "margin": self.margin, "warmup": not self.full,
                "anchored": self.anchored}  # fmt: skip

    def may_stop(self, epoch: int) -> bool:
        return not self.anchored  # the anchor epochs are a fixed part of the objective

    def __call__(self, model: torch.nn.Module, item: CellBatch) -> tuple[torch.Tensor, ...]:
        idx = item.rows
        return orca_loss_terms(
            model, item.x, self.y_all[idx], self.margin, self.lab, self.generator,
            full=self.full, prior=self.prior,
            y_anchor=self.y_anchor[idx] if self.anchored else None,
            pair_features=self.pair_features[idx] if self.pair_features is not None else None,
            pair_fixed_only=(self.pair_fixed_only[idx] if self.pair_fixed_only is not None
                             else None),
        )  # fmt: skip


#: the margin's mean uncertainty is taken over at most this many unlabelled cells (a fixed
#: sample): the standard error of a mean of values in [0, 1] is then below 0.005
UNCERTAINTY_CELLS = 10_000


def _uncertainty_rows(unl_idx: np.ndarray, seed: int) -> np.ndarray:
    """The unlabelled cells whose mean uncertainty sets the margin (all, or a fixed sample)."""
    if unl_idx.size <= UNCERTAINTY_CELLS:
        return unl_idx
    rng = np.random.default_rng([seed, 0x0CE7])
    return np.sort(rng.choice(unl_idx, size=UNCERTAINTY_CELLS, replace=False))


def _distributed(net: OrcaNet, device: torch.device, comm: Comm | None):
    """``net`` wrapped for ``DistributedDataParallel`` over ``comm`` (``net`` itself alone)."""
    if comm is None:
        return net
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    # buffers (BatchNorm running statistics) move the same on every rank: not broadcast
    return DistributedDataParallel(
        net, device_ids=ids, forward_sync_buffers=False, process_group=comm.group
    )


def _adam(net: OrcaNet, config: OrcaConfig) -> torch.optim.Adam:
    """Adam with its fused kernel where there is one (CPU, CUDA): on 2 CPU threads 0.4 ms per
    step against 6.3 ms for the per-parameter loop.
    """
    kw = {"lr": config.lr}
    try:
        return torch.optim.Adam(net.parameters(), fused=True, **kw)
    except RuntimeError:  # no fused kernel for this device
        return torch.optim.Adam(net.parameters(), **kw)


def orca_loss_terms(
    net, x, y, margin: float, lab: Ablation, gen: torch.Generator | None, *, full: bool,
    prior=None, y_anchor=None, pair_features=None, pair_fixed_only=None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Eq. 1 on one batch: L = L_S + eta1 L_P + eta2 R, each term switchable (``full=False``:
    the warm-up's supervised term alone). ``prior``, ``y_anchor`` and ``pair_features``: the
    phase's per-cell tensors taken for this batch. With ``y_anchor`` (``-1`` for cells not
    anchored) ``anchor_weight`` times the plain cross-entropy of the anchored candidate novel
    cells towards their clusters' heads is added (no margin: the margin eases seen classes, not
    candidates). Returns ``(loss, supervised, pairwise, regulariser, anchor)``.

    In a step on several processes (:func:`orca_sc._dist.active_shard`) ``x`` is this rank's
    part of the batch whose labels etc. are given; the net's outputs are gathered, so the loss
    is that of the whole batch.
    """
    shard = active_shard()
    if not full:  # the warm-up's batches hold labelled cells only
        logits, _ = net(x)  # (B, K)
        if shard is not None:
            logits = shard.gather(logits)
        zero = logits.sum() * 0.0
        sup = margin_cross_entropy(logits, y, margin) if lab.supervised else zero
        return sup, sup, zero, zero, zero
    (logits, feat), (logits2, _) = net(x, views=2)  # two dropout masks
    if shard is not None:  # one exchange for the three
        k, d = logits.shape[1], feat.shape[1]
        joined = shard.gather(torch.cat([logits, logits2, feat], dim=1))
        logits, logits2, feat = joined[:, :k], joined[:, k : 2 * k], joined[:, 2 * k : 2 * k + d]
    zero = logits.sum() * 0.0
    anchor = zero
    if y_anchor is not None:
        anchor = masked_margin_cross_entropy(logits, y_anchor, 0.0)
    similarity = None
    if pair_features is None:  # pair_space="embedding"
        space = feat
    elif lab.pair_space == "query_pca" and pair_fixed_only is not None:
        space = feat  # its shape only: the partners are read in the two similarities
        similarity = split_cosine_similarity(pair_features, feat, pair_fixed_only)
    elif lab.pair_space in ("both", "query_pca"):  # "query_pca" without a query cell
        space = joint_cosine_features(pair_features, feat)
    else:
        space = pair_features
    terms = orca_objective(
        logits,
        logits2,
        space,
        y,
        margin,
        eta1=lab.eta1,
        eta2=lab.eta2,
        prior=prior,
        generator=gen,
        mutual=lab.mutual_pairs,
        supervised=lab.supervised,
        regularizer=lab.regularizer,
        pair_similarity=similarity,
    )
    loss = terms.loss + lab.anchor_weight * anchor
    return loss, terms.supervised, terms.pairwise, terms.regularizer, anchor


@torch.no_grad()
def infer(
    net: OrcaNet, data: CellMatrix, rows: np.ndarray | None = None, comm: Comm | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax probabilities ``(n, K)`` and L2-normalised embeddings ``(n, D)`` in eval mode
    (with several processes, ``comm``: each rank infers its share, and all get all rows).
    """
    net.eval()
    rows = np.arange(data.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
    if comm is not None and comm.active:
        probs, embs = infer(net, data, rows[comm.share(rows.size)])
        return comm.gather_rows(probs), comm.gather_rows(embs)
    probs = np.empty((rows.size, net.n_heads), dtype=np.float32)
    embs = np.empty((rows.size, net.head.weight.shape[1]), dtype=np.float32)
    for lo in range(0, rows.size, _INFER_CHUNK):
        chunk = rows[lo : lo + _INFER_CHUNK]
        logits, z = net(data.batch(chunk))
        probs[lo : lo + chunk.size] = F.softmax(logits, dim=1).cpu().numpy()
        embs[lo : lo + chunk.size] = F.normalize(z, dim=1).cpu().numpy()
    return probs, embs


#: cosines computed at once by :func:`knn_mean_distance` (16 MiB of float32: on 2 CPU threads
#: 75,000 cells against 2,000 took 0.33 s in blocks of 16 MiB, 0.46 s in blocks of 256 MiB)
KNN_BLOCK_VALUES = 1 << 22


@torch.no_grad()
def knn_mean_distance(
    reference: np.ndarray, cells: np.ndarray, k: int, device: torch.device
) -> np.ndarray:
    """Mean cosine distance ``(n,)`` of each row of ``cells`` to its ``k`` nearest rows of
    ``reference`` (both L2-normalised, ``(m, D)`` and ``(n, D)``): the nonconformity score of
    :mod:`orca_sc._conformal`, found exactly as blocks of cosines and their top ``k`` on
    ``device`` (on 2 CPU threads a third of the time of scikit-learn's brute-force search at
    2,000 x 75,000 cells, as fast at 10,000; on a GPU a few milliseconds).
    """
    k = int(min(k, reference.shape[0]))
    ref = torch.as_tensor(reference, dtype=torch.float32, device=device)
    out = torch.empty(cells.shape[0], dtype=torch.float64, device=device)
    step = max(1, KNN_BLOCK_VALUES // max(1, ref.shape[0]))
    for lo in range(0, cells.shape[0], step):
        block = torch.as_tensor(cells[lo : lo + step], dtype=torch.float32, device=device)
        top = (block @ ref.T).topk(k, dim=1).values
        out[lo : lo + step] = (1.0 - top).mean(dim=1)
    return out.cpu().numpy()
