"""Neural-network layers and ORCA's losses. Tensors and sizes only: no AnnData here.

Shapes in comments: ``B`` cells in the mini-batch, ``G`` genes, ``D`` embedding size, ``K`` heads.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._config import HEAD_SCALE
from ._dist import active_shard

_EPS = 1e-7


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


# --------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------
def margin_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, margin: float, scale: float = HEAD_SCALE
) -> torch.Tensor:
    """Supervised term with the uncertainty-adaptive margin (paper Eq. 3).

    ``logits`` are ``s * cos`` from :class:`NormedLinear`. The target logit becomes
    ``s * (cos + margin)``: a positive ``margin`` makes the true class *easier*, which is the paper's
    "negative margin" that keeps seen classes from tightening faster than novel ones. ``margin = 0``
    is plain cross-entropy.
    """
    if target.numel() == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(logits + scale * margin * _onehot(logits, target), target)


def _onehot(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``F.one_hot(target, K)`` in ``logits``' dtype, without its range check (which makes a GPU
    wait for the host).
    """
    return torch.zeros_like(logits).scatter_(1, target[:, None], 1.0)


def masked_margin_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, margin: float, scale: float = HEAD_SCALE
) -> torch.Tensor:
    """:func:`margin_cross_entropy` over the rows with ``target >= 0`` (the others are
    ignored; 0 when there are none), without selecting them: a boolean selection would make a
    GPU wait for the host on every step.
    """
    lab = target >= 0
    onehot = _onehot(logits, target.clamp_min(0))  # (B, K)
    total = F.cross_entropy(
        logits + scale * margin * onehot, target, ignore_index=-1, reduction="sum"
    )
    return total / lab.sum().clamp_min(1)


def pairwise_loss(prob: torch.Tensor, prob_pair: torch.Tensor) -> torch.Tensor:
    """Pairwise objective (paper Eq. 4): ``mean(-log <p_i, p'_j>)`` over the chosen positive pairs."""
    if prob.shape[0] == 0:
        return prob.sum() * 0.0
    sim = (prob * prob_pair).sum(dim=1)  # (B,)
    return -torch.log(sim.clamp_min(_EPS)).mean()


def entropy_regularizer(prob: torch.Tensor, prior: torch.Tensor | None = None) -> torch.Tensor:
    """Regulariser of the mean prediction (paper Eq. 5): ``KL(mean p || prior)``.

    With the uniform prior (``None``) this is ``log K - H(mean p)``, the paper's maximum-entropy
    regulariser; zero when the heads are used as the prior says.
    """
    mean = prob.mean(dim=0)  # (K,)
    if prior is None:
        entropy = -(mean * torch.log(mean.clamp_min(_EPS))).sum()
        return math.log(prob.shape[1]) - entropy
    return (mean * (torch.log(mean.clamp_min(_EPS)) - torch.log(prior.clamp_min(_EPS)))).sum()


def joint_cosine_features(*spaces: torch.Tensor) -> torch.Tensor:
    """Features whose cosine similarity is the mean of the cosine similarities in ``spaces``.

    Each ``(B, D_i)`` tensor is L2-normalised and they are concatenated (detached): for two
    rows, the dot product of the result is the sum of their cosines, and its norm is
    ``sqrt(len(spaces))``, so its cosine is their mean. :func:`select_pairs` on these features
    picks the partner that is closest on average over the spaces.
    """
    return torch.cat([F.normalize(s.detach(), dim=1) for s in spaces], dim=1)


def split_cosine_similarity(
    fixed: torch.Tensor, learned: torch.Tensor, fixed_only: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two ``(B, B)`` similarities for :func:`select_pairs` and the rows that read the first:
    the cosines in the ``fixed`` ``(B, P)`` space alone, and the mean of the cosines in it and
    in the ``learned`` ``(B, D)`` space (as :func:`joint_cosine_features`). A row of
    ``fixed_only`` finds its partner, and is checked among the partner's nearest cells, in the
    first; every other row in the second.
    """
    p = F.normalize(fixed.detach(), dim=1)
    joint = F.normalize(joint_cosine_features(fixed, learned), dim=1)
    return p @ p.T, joint @ joint.T, fixed_only


def select_pairs(
    features: torch.Tensor,
    labels: torch.Tensor,
    generator: torch.Generator | None = None,
    mutual: int = 0,
    similarity: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Index of each cell's positive partner within the mini-batch (paper §3.3).

    Labelled cells (``labels >= 0``) get a random *other* cell of the same class in the batch (itself
    when it is its class's only cell in the batch). Unlabelled cells get their nearest neighbour by
    cosine similarity among all other cells of the batch. With ``mutual = k > 0``, that neighbour
    is kept only when the cell is also among the neighbour's ``k`` nearest cells of the batch;
    otherwise the cell is its own partner (the pairwise term then asks its two dropout views to
    agree). ``similarity``: two ``(B, B)`` similarities and a ``(B,)`` mask to use instead of
    the cosines of ``features`` (:func:`split_cosine_similarity`): a masked row's neighbour, and
    the neighbour's nearest cells, are read in the first, every other row's in the second; both
    are used up (their diagonals overwritten).
    Fully vectorised: ``O(B^2)`` on the batch.
    """
    n = features.shape[0]
    device = features.device
    self_idx = torch.arange(n, device=device)
    # unlabelled: cosine nearest neighbour, self excluded
    if similarity is None:
        f = F.normalize(features.detach(), dim=1)
        nn_idx = _nearest(f @ f.T, mutual, self_idx)  # (B, B) cosines
    else:  # both read for every row (no wait on the device), each row keeps its own
        first, second, use_first = similarity
        nn_idx = torch.where(use_first, _nearest(first.detach(), mutual, self_idx),
                             _nearest(second.detach(), mutual, self_idx))  # fmt: skip
    lab = labels >= 0
    partner = _random_class_partner(labels, generator)
    return torch.where(lab, partner, nn_idx) if n > 1 else self_idx


def _nearest(sim: torch.Tensor, mutual: int, self_idx: torch.Tensor) -> torch.Tensor:
    """Each row's nearest other cell by ``sim`` (changed in place: its diagonal), or the cell
    itself where it is not among that cell's ``mutual`` nearest (:func:`select_pairs`).
    """
    n = sim.shape[0]
    sim.fill_diagonal_(-math.inf)
    if mutual > 0 and n > 2:
        # a cell that is not among its neighbour's k nearest cells sits outside the neighbour's
        # group (e.g. the batch holds no other cell of its type): pair it with itself
        topk = sim.topk(min(mutual, n - 1), dim=1).indices  # (B, k), nearest first
        nn_idx = topk[:, 0]
        is_mutual = (topk[nn_idx] == self_idx[:, None]).any(dim=1)
        return torch.where(is_mutual, nn_idx, self_idx)
    return sim.argmax(dim=1)


def _random_class_partner(labels: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """For each cell a uniformly random *other* cell of its label (itself when it is alone):
    the cells of each label are put in a random cyclic order and each is paired with the next.
    In a uniformly random cycle the next cell is uniform among the others, so each cell's
    partner has the distribution of an independent draw (the partners of different cells are
    no longer independent of each other; the loss's expectation is the same). It costs ``B``
    random numbers and two sorts of ``B`` keys (``B x B`` random numbers and a masked argmax
    before). Static shapes: no wait on the device.
    """
    n = labels.shape[0]
    device = labels.device
    # drawn where the generator lives (the training device: no copy from the host)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    shuffled = torch.argsort(torch.rand(n, generator=generator, device=gen_device).to(device))
    order = shuffled[torch.argsort(labels[shuffled], stable=True)]  # by label, random within
    run = labels[order]
    pos = torch.arange(n, device=device)
    first = torch.ones(n, dtype=torch.bool, device=device)
    last = torch.ones(n, dtype=torch.bool, device=device)
    first[1:] = run[1:] != run[:-1]
    last[:-1] = first[1:]
    start = torch.cummax(torch.where(first, pos, 0), dim=0).values  # first position of the run
    nxt = torch.where(last, start, pos + 1)  # the next cell of the run, cyclically
    partner = torch.empty_like(order)
    partner[order] = order[nxt]
    return partner


# --------------------------------------------------------------------------------------------
# the whole objective: one implementation for single-cell and vision
# --------------------------------------------------------------------------------------------
def adaptive_margin(
    mode: str, uncertainty: float, lam: float = 1.0, max_margin: float = 0.5, fixed: float = 0.5
) -> float:
    """The margin of the supervised term for one epoch (paper Eq. 3-4).

    ``"adaptive"``: ``min(lam * uncertainty, max_margin)`` with ``uncertainty`` the mean
    ``1 - max softmax`` of the unlabelled examples (the reference code caps it at 0.5);
    ``"fixed"``: ``fixed`` (ORCA-FNM, 0.5 in the paper); ``"zero"``: 0 (ORCA-ZM).
    """
    if mode == "adaptive":
        return min(lam * uncertainty, max_margin)
    if mode == "fixed":
        return fixed
    if mode == "zero":
        return 0.0
    raise ValueError(f"margin mode must be 'adaptive', 'fixed' or 'zero', not {mode!r}")


class ObjectiveTerms(NamedTuple):
    """``loss = supervised + eta1 * pairwise + eta2 * regularizer`` and its terms (0-d tensors)."""

    loss: torch.Tensor
    supervised: torch.Tensor
    pairwise: torch.Tensor
    regularizer: torch.Tensor


def orca_objective(
    logits: torch.Tensor,
    logits_pair: torch.Tensor,
    pair_space: torch.Tensor,
    labels: torch.Tensor,
    margin: float,
    *,
    eta1: float = 1.0,
    eta2: float = 1.0,
    prior: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    mutual: int = 0,
    supervised: bool = True,
    regularizer: bool = True,
    scale: float = HEAD_SCALE,
    pair_similarity: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> ObjectiveTerms:
    """ORCA's objective on one mini-batch (paper Eq. 1): margin cross-entropy on the labelled
    examples, pairwise term on each example's positive partner, regulariser of the mean prediction.

    ``logits`` ``(B, K)`` from one forward pass; ``logits_pair`` ``(B, K)`` from a second one (another
    dropout mask for cells, another augmented view for images): each example's prediction is
    compared with its partner's prediction in the second pass. ``pair_space`` ``(B, P)``: where
    unlabelled examples look for their nearest neighbour (:func:`select_pairs`); ``labels`` ``(B,)``
    class index, ``-1`` for unlabelled; ``pair_similarity``: their similarities, where given
    (:func:`split_cosine_similarity`). Used unchanged by the single-cell trainer and by
    :mod:`orca_sc.vision`.
    """
    zero = logits.sum() * 0.0
    sup = masked_margin_cross_entropy(logits, labels, margin, scale) if supervised else zero
    prob = F.softmax(logits, dim=1)
    prob2 = F.softmax(logits_pair, dim=1)
    pair_idx = select_pairs(pair_space, labels, generator, mutual=mutual,
                            similarity=pair_similarity)  # fmt: skip
    # index_select, not prob2[pair_idx]: the indexed gather's backward accumulates the rows of
    # partners shared by several cells on several threads in a varying order (with hundreds of
    # heads), so the same seed gave other labels
    pair = pairwise_loss(prob, prob2.index_select(0, pair_idx))
    reg = entropy_regularizer(prob, prior) if regularizer else zero
    return ObjectiveTerms(sup + eta1 * pair + eta2 * reg, sup, pair, reg)
