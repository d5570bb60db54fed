"""Neural-network layers and ORCA's losses. Tensors and sizes only: no AnnData here.

Shapes in comments: ``B`` cells in the mini-batch, ``G`` genes, ``D`` embedding size, ``K`` heads.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._config import HEAD_SCALE
from ._dist import active_shard


@dataclass(frozen=True)
class SparseRows:
    """A mini-batch for the first layer as sparse matrices: ``x`` ``(B, G)`` CSR with the
    per-batch scale applied, its transpose ``xt`` ``(G, B)`` for the weight gradient (``None``
    where no gradient is taken: inference), each cell's batch one-hot ``member``
    ``(B, n_batches)`` and the per-batch offsets ``offset`` ``(n_batches, G)`` added to every
    row (``None``: no offset).
    """

    x: torch.Tensor
    xt: torch.Tensor | None
    member: torch.Tensor
    offset: torch.Tensor | None


class _SparseMatmul(torch.autograd.Function):
    """``x @ weight_t`` for a sparse ``x`` whose transpose is given.

    Forward: each row of ``x`` is a weighted bag of the weight's gene rows, which
    :func:`torch.nn.functional.embedding_bag` sums (512 x 2,000 at 5.6% non-zeros times
    2,000 x 512, 2 CPU threads: 1.0 ms against 2.0 ms for ``torch.sparse.mm``). Backward: the
    weight gradient ``x.T @ grad`` is a sparse product with the given transpose (1.8 ms;
    embedding_bag's own backward, or torch's backward of a CSR product, is slower).
    """

    @staticmethod
    def forward(ctx, x, xt, weight_t):  # (B, G) CSR, (G, B) CSR, (G, H) -> (B, H)
        ctx.save_for_backward(xt)
        return F.embedding_bag(
            x.col_indices(),
            weight_t,
            x.crow_indices(),
            mode="sum",
            per_sample_weights=x.values(),
            include_last_offset=True,
        )

    @staticmethod
    def backward(ctx, grad):  # (B, H)
        (xt,) = ctx.saved_tensors
        return None, None, torch.sparse.mm(xt, grad)  # (G, H), the layout of weight_t


class GeneLinear(nn.Module):
    """``nn.Linear(n_in, n_out)`` (same initial values, same ``state_dict``: ``weight``
    ``(n_out, n_in)`` and ``bias``) whose weight is held transposed, as the contiguous
    ``(n_in, n_out)`` parameter ``weight_t``.

    The first layer multiplies a batch by ``W.T``, the sparse product's backward writes the
    gradient as ``(G, H)``, and Adam's fused kernel needs a contiguous parameter: held as
    ``(G, H)``, none of the three makes a transposing copy of the ``G x H`` matrix (a
    column-major ``(H, G)`` parameter cost Adam 2.5 ms against 0.5 ms per step for 2,000 x 512
    on 2 CPU threads; a row-major one the sparse product 8.4 ms against 5.0 ms).
    """

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        init = nn.Linear(n_in, n_out)  # nn.Linear's initialisation and random draws
        self.in_features, self.out_features = n_in, n_out
        self.weight_t = nn.Parameter(init.weight.detach().t().contiguous())
        self.bias = nn.Parameter(init.bias.detach().clone())
        self.register_state_dict_post_hook(_save_weight_as_linear)
        self.register_load_state_dict_pre_hook(_load_weight_as_linear)

    @property
    def weight(self) -> torch.Tensor:
        """The ``(n_out, n_in)`` weight of ``nn.Linear`` (a view of ``weight_t``)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, n_in) -> (B, n_out)
        return torch.addmm(self.bias, x, self.weight_t)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _save_weight_as_linear(module, state_dict, prefix, local_metadata) -> None:
    w = state_dict.pop(prefix + "weight_t")
    state_dict[prefix + "weight"] = w.t()
    state_dict.move_to_end(prefix + "weight", last=False)  # nn.Linear's order: weight, bias


def _load_weight_as_linear(module, state_dict, prefix, *args) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[prefix + "weight_t"] = state_dict.pop(key).t()


def first_linear(linear: GeneLinear, x: torch.Tensor | SparseRows) -> torch.Tensor:
    """``linear`` applied to a dense batch or to :class:`SparseRows` (same values: the aligned
    row is ``x * scale + offset``, so its product is the sparse product plus ``offset @ W.T``).
    """
    if isinstance(x, torch.Tensor):
        return linear(x)
    out = _SparseMatmul.apply(x.x, x.xt, linear.weight_t)
    if x.offset is not None:
        # a product with the one-hot batches, not an index: the index's backward scatter-adds
        # in an order that varies between runs with 2 CPU threads (same seed, other weights)
        out = out + x.member @ (x.offset @ linear.weight_t)
    return out + linear.bias


def dropout(h: torch.Tensor, p: float, training: bool, shard: Any = None) -> torch.Tensor:
    """Inverted dropout, as :func:`torch.nn.functional.dropout`, with the mask of
    :func:`keep_mask` (16-bit draws) applied as one product: forward and backward of 512 x 512
    on 2 CPU threads take 1.0 ms, against 3.1 ms with a mask of ``torch.rand`` floats (and 4.9
    ms for the forward alone with torch's Bernoulli draws). Same distribution up to the
    rounding of ``p``.

    ``shard`` (:class:`orca_sc._dist.BatchShard`, ``h`` being this rank's rows of a global
    batch): the mask is drawn for the whole batch and this rank's rows kept, so that several
    ranks drop what one process would.
    """
    if not training or p == 0:
        return h
    rows = h.shape[0] if shard is None else shard.total
    keep = keep_mask((rows, *h.shape[1:]), p, h.device)
    if shard is not None:
        keep = keep[shard.lo : shard.lo + shard.n]
    return h * keep.to(h.dtype).mul_(1.0 / (1.0 - p))


def keep_mask(shape: tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """A boolean tensor of ``shape``, each entry ``False`` with probability ``p`` rounded to a
    multiple of ``2**-16`` (0.1 -> 0.100006), independently: every 64-bit random integer gives
    four 16-bit draws (on 2 CPU threads 0.33 ms for 512 x 512 against 0.96 ms for the uniform
    floats of ``torch.rand``).
    """
    cut = round(p * 2**16)
    if cut >= 2**16:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    n = math.prod(shape)
    words = torch.randint(-(2**63), 2**63 - 1, (-(-n // 4),), dtype=torch.int64, device=device)
    u = words.view(torch.int16)[:n].view(shape)  # uniform on [-2**15, 2**15)
    return u >= cut - 2**15


def synced_batch_norm(
    h: torch.Tensor, bn: nn.BatchNorm1d, shard: Any, passes: int = 1
) -> torch.Tensor:
    """``bn`` in training mode over the global batch whose rows ``h`` are this rank's part
    (``shard``): mean and variance summed over the ranks, differentiably, and the running
    statistics moved as one process would for ``passes`` passes of the batch.
    (``torch.nn.SyncBatchNorm`` runs on GPUs only.)
    """
    n = shard.total
    # one exchange for both moments, in float64 so that E[h^2] - E[h]^2 loses nothing
    h64 = h.double()
    sums = shard.sum(torch.cat([h64.sum(dim=0), (h64 * h64).sum(dim=0)])) / n
    mean64, sq64 = sums.chunk(2)
    mean = mean64.to(h.dtype)
    var = (sq64 - mean64 * mean64).clamp_min(0).to(h.dtype)  # biased, as in the normalisation
    out = (h - mean) * torch.rsqrt(var + bn.eps)
    if bn.affine:
        out = out * bn.weight + bn.bias
    if bn.track_running_stats:
        for _ in range(passes):
            _move_running_stats(bn, mean.detach(), var.detach() * (n / max(n - 1, 1)))
    return out


def _move_running_stats(bn: nn.BatchNorm1d, mean: torch.Tensor, var: torch.Tensor) -> None:
    with torch.no_grad():
        bn.num_batches_tracked += 1
        m = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
        bn.running_mean.mul_(1 - m).add_(mean, alpha=m)
        bn.running_var.mul_(1 - m).add_(var, alpha=m)


class ShardDropout(nn.Dropout):
    """:class:`torch.nn.Dropout` with the masks of :func:`dropout`; in a step on several
    processes (:func:`orca_sc._dist.active_shard`) the mask is that of the whole batch.
    """

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return dropout(h, self.p, self.training, active_shard())


class ShardBatchNorm1d(nn.BatchNorm1d):
    """:class:`torch.nn.BatchNorm1d` whose training statistics are those of the whole batch in a
    step on several processes (:func:`orca_sc._dist.active_shard`); ``passes``: its running
    statistics move as for that many passes of the batch.
    """

    def forward(self, h: torch.Tensor, passes: int = 1) -> torch.Tensor:
        shard = active_shard()
        if shard is not None and self.training:  # one exchange for all passes
            return synced_batch_norm(h, self, shard, passes)
        out = super().forward(h)
        if self.training and self.track_running_stats:
            with torch.no_grad():  # the other passes' updates of the running statistics
                for _ in range(passes - 1):
                    super().forward(h.detach())
        return out


class MLPBackbone(nn.Module):
    """Two fully connected blocks: Linear -> BatchNorm -> ReLU -> Dropout (the paper's single-cell
    backbone). The output of the second block is the cell embedding. In a training step on
    several processes the BatchNorm statistics and dropout masks are those of the whole batch
    (:func:`orca_sc._dist.sharded`).
    """

    def __init__(self, n_in: int, hidden_dims: tuple[int, int], dropout: float) -> None:
        super().__init__()
        h1, h2 = hidden_dims
        self.net = nn.Sequential(
            GeneLinear(n_in, h1),
            ShardBatchNorm1d(h1),
            nn.ReLU(),
            ShardDropout(dropout),
            nn.Linear(h1, h2),
            ShardBatchNorm1d(h2),
            nn.ReLU(),
            ShardDropout(dropout),
        )

    def forward(self, x: torch.Tensor | SparseRows) -> torch.Tensor:
        """``(B, G) -> (B, D)``."""
        return self._block2(self._trunk(x))

    def _trunk(self, x: torch.Tensor | SparseRows, passes: int = 1) -> torch.Tensor:
        """Linear -> BatchNorm -> ReLU: everything before the first dropout. In training, the
        BatchNorm's running statistics move as for ``passes`` passes of the batch.
        """
        h = first_linear(self.net[0], x)
        return self.net[2](self.net[1](h, passes))

    @property
    def first_layer(self) -> GeneLinear:
        """The first layer (genes -> ``h1``)."""
        return self.net[0]

    @property
    def first_norm(self) -> ShardBatchNorm1d:
        """The BatchNorm after the first layer."""
        return self.net[1]

    def after_first_layer(self, h: torch.Tensor) -> torch.Tensor:
        """The rest of the backbone from the first layer's output ``h`` ``(B, h1) -> (B, D)``:
        what :meth:`forward` does after the first layer (one pass).
        """
        return self._block2(self.net[2](self.net[1](h)))

    def _block2(self, h: torch.Tensor) -> torch.Tensor:
        """Dropout -> Linear -> BatchNorm -> ReLU -> Dropout."""
        for layer in self.net[3:]:
            h = layer(h)
        return h

    def forward_views(self, x: torch.Tensor | SparseRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Two forward passes of the same cells that differ only in their dropout masks (ORCA's
        two views of a cell), sharing the computation before the first dropout: the first
        layer (the costliest, ``G x h1``) runs once. Same values and gradients as two calls of
        :meth:`forward`, and the first BatchNorm's running statistics move as they would for
        two passes. Returns the two ``(B, D)`` embeddings.
        """
        a = self._trunk(x, passes=2)
        return self._block2(a), self._block2(a)


class NormedLinear(nn.Module):
    """Cosine classifier: ``s * <z/|z|, W_k/|W_k|>``; outputs are bounded by ``s`` in absolute value.

    Normalising inputs and weights keeps the magnitudes of seen-class weights from growing faster
    than those of novel heads, so the margin is meaningful (paper §3.2).
    """

    def __init__(
        self, n_in: int, n_out: int, scale: float = HEAD_SCALE, weight: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.scale = scale
        if weight is None:
            self.weight = nn.Parameter(torch.empty(n_out, n_in))
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        else:  # given initial weights (n_out, n_in): no random draw
            self.weight = nn.Parameter(weight.detach().clone().reshape(n_out, n_in))

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, K)
        return self.scale * F.normalize(z, dim=1) @ F.normalize(self.weight, dim=1).T


class OrcaNet(nn.Module):
    """Backbone + normalised head over ``n_seen + n_novel`` classes."""

    def __init__(
        self, n_genes: int, n_heads: int, hidden_dims: tuple[int, int], dropout: float
    ) -> None:
        super().__init__()
        self.backbone = MLPBackbone(n_genes, hidden_dims, dropout)
        self.head = NormedLinear(hidden_dims[1], n_heads)

    def forward(self, x: torch.Tensor | SparseRows, views: int = 1):
        """``(logits (B, K), features (B, D))``; with ``views=2`` that pair for each of two
        dropout masks (see :meth:`forward_views`). (One entry point, so that a
        ``DistributedDataParallel`` wrapper sees every call.)
        """
        if views == 2:
            return self.forward_views(x)
        z = self.backbone(x)  # (B, D)
        return self.head(z), z  # (B, K) logits, (B, D) features

    def forward_views(self, x: torch.Tensor | SparseRows):
        """:meth:`forward` twice, with two dropout masks (see :meth:`MLPBackbone.forward_views`):
        ``((logits, features), (logits2, features2))``.
        """
        z1, z2 = self.backbone.forward_views(x)
        return (self.head(z1), z1), (self.head(z2), z2)

    @property
    def n_heads(self) -> int:
        return int(self.head.weight.shape[0])

    def with_novel_heads(self, prototypes: torch.Tensor) -> OrcaNet:
        """A new net: a copy of this one with heads appended, initialised at ``prototypes``
        ``(n_new, D)`` (this net is left as it is; no random draw).
        """
        net = copy.deepcopy(self)
        w = self.head.weight.detach()
        new = torch.cat([w, prototypes.to(w)], dim=0)  # (K + n_new, D)
        net.head = NormedLinear(w.shape[1], new.shape[0], self.head.scale, weight=new)
        return net


class BatchDecoder(nn.Module):
    """A decoder of a cell's input from its embedding and its batch (one-hot): Linear -> ReLU
    -> Linear to the genes (``Ablation.warmup_recon``). Conditioned on the batch, it leaves
    the batch's own differences to the one-hot, so that the embedding need not carry them.
    """

    def __init__(self, n_in: int, n_batches: int, n_genes: int, hidden: int = 512) -> None:
        super().__init__()
        self.n_batches = n_batches
        self.net = nn.Sequential(
            nn.Linear(n_in + n_batches, hidden), nn.ReLU(), nn.Linear(hidden, n_genes)
        )

    def forward(self, z: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        member = F.one_hot(batch, self.n_batches).to(z.dtype)
        return self.net(torch.cat([z, member], dim=1))


def dense_input(x: torch.Tensor | SparseRows) -> torch.Tensor:
    """A mini-batch as the first layer reads it, as a dense ``(B, G)`` tensor (one batch)."""
    if isinstance(x, torch.Tensor):
        return x
    out = x.x.to_dense()
    if x.offset is not None:
        out = out + x.member @ x.offset
    return out


class Projector(nn.Module):
    """SimCLR's projection head: Linear -> ReLU -> Linear to ``dim``."""

    def __init__(self, n_in: int, dim: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, n_in), nn.ReLU(), nn.Linear(n_in, dim))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)
