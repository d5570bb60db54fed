"""The training matrix and the device: where the cells live during training (a CSR matrix on the
host, or resident on the GPU), reproducible kernels, and inference over the cells in chunks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from ._align import aligned_rows
from ._dist import Comm
from ._errors import ConfigError
from .module import (
    OrcaNet,
    SparseRows,
)

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

    def dense_batch(self, idx: np.ndarray) -> torch.Tensor:
        """The rows ``idx`` as :meth:`batch` gives them, but always a dense ``(len(idx), G)``
        tensor on the device (one mini-batch; the matrix itself stays as it is): for what
        changes the values before the first layer.
        """
        if self.layout == "sparse":
            return torch.from_numpy(self._aligned(idx)).to(self.device)
        return self.batch(idx)

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
