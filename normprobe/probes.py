"""The statistics normprobe logs, as pure tensor functions.

Every function reduces in float32 and returns tensors on the input's device: nothing here
reads a value back to the host.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _wide(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square of all elements: sqrt(mean(x^2)), reduced in float32 or wider."""
    return torch.linalg.vector_norm(x.detach(), dtype=_wide(x)) / math.sqrt(max(x.numel(), 1))


def rms_many(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`rms` of each tensor, as one float32 vector, in one batched reduction."""
    if _any_dtensor(tensors) or any(t.dtype == torch.float64 for t in tensors):
        return torch.stack([rms(t).float() for t in tensors])
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    scales = [1 / math.sqrt(max(t.numel(), 1)) for t in tensors]
    return _stacked(torch._foreach_mul(norms, scales))


def _stacked(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Scalars (possibly on several devices) as one vector on the first one's device."""
    device = values[0].device
    return torch.stack([v if v.device == device else v.to(device) for v in values])


def feature_dim(x: torch.Tensor) -> int:
    """The feature axis: channels (dim 1) for images (N, C, H, W), else the last one."""
    return 1 if x.ndim >= 4 else -1


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """L2 norm of the feature vector (along `feature_dim`) at each position, flattened into one
    vector, in float32 or wider. Its own L2 norm is ``x``'s."""
    return torch.linalg.vector_norm(x.detach(), dim=feature_dim(x), dtype=_wide(x)).reshape(-1)


def rms_from_row_norms(norms: torch.Tensor, numel: int) -> torch.Tensor:
    """The RMS of a tensor of ``numel`` elements from its `row_norms` (last axis); rows of
    several tensors of that size stacked give one RMS each."""
    return torch.linalg.vector_norm(norms, dim=-1) / math.sqrt(max(numel, 1))


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot product of ``a`` and ``b`` along `feature_dim` at each position, flattened like
    `row_norms`, in float32 or wider."""
    wide, dim = _wide(a), feature_dim(a)
    return torch.linalg.vecdot(a.detach().to(wide), b.detach().to(wide), dim=dim).reshape(-1)


def cosines_from_rows(
    dots: torch.Tensor, norms_a: torch.Tensor, norms_b: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """Mean over positions (the last axis) of ``dots / (norms_a * norms_b)``, each norm at
    least ``eps``; rows stacked along a first axis give one mean cosine per pair of tensors."""
    return (dots / (norms_a.clamp_min(eps) * norms_b.clamp_min(eps))).mean(dim=-1)


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of ``a`` and ``b`` along the feature axis, averaged over positions.

    Between consecutive blocks' residual streams this approaches 1 when deep blocks stop
    changing the representation (Pre-LN representation collapse).
    """
    return cosines_from_rows(row_dots(a, b), row_norms(a), row_norms(b))


def _dtensor_type() -> type[DTensor] | None:
    module = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    return getattr(module, "DTensor", None)


def _any_dtensor(tensors: Sequence[torch.Tensor]) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallel), else ``t``: no collective."""
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def shard_share(t: torch.Tensor) -> float:
    """The weight of this rank's shard of ``t`` in a sum over all ranks: 1 / the number of
    ranks holding the same shard (HSDP's replicas) for a DTensor, 1 for a plain tensor."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return 1.0
    mesh = t.device_mesh
    shards = math.prod(mesh.size(d) for d, place in enumerate(t.placements) if place.is_shard())
    return shards / torch.distributed.get_world_size()


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are sharded across ranks: DTensors (FSDP2), or FSDP1
    modules inside it that shard (any strategy but ``NO_SHARD``)."""
    dtensor = _dtensor_type()
    if dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters()):
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and any(
        isinstance(m, fsdp.FullyShardedDataParallel)
        and m.sharding_strategy != fsdp.ShardingStrategy.NO_SHARD
        for m in model.modules()
    )


def gain_moments(weight: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """(sum, sum of squares, count) of ``offset + weight - 1`` over this rank's shard.

    Summed over ranks, `gain_from_moments` turns them into the whole gain's (mean, std).
    """
    g = local(weight).detach().float() + (offset - 1.0)
    return torch.stack([g.sum(), g.pow(2).sum(), g.new_full((), g.numel())])


def gain_from_moments(total: float, squares: float, count: float) -> tuple[float, float]:
    """(mean, std) of a gain from its summed `gain_moments` (host floats)."""
    if count <= 0:
        return math.nan, math.nan
    mean = total / count
    return 1.0 + mean, math.sqrt(max(squares / count - mean * mean, 0.0))


@functools.lru_cache(maxsize=256)  # a stream's shape comes back at every logged step
def sample_stride(shape: tuple[int, ...], budget: int) -> int:
    """Stride for an evenly spread sample of at most ``budget`` entries of a tensor.

    1 (every entry) when the tensor fits; otherwise a prime that does not divide the last
    dimension, so that the sample walks through all columns instead of repeating a few.
    """
    numel = math.prod(shape)
    if numel <= budget:
        return 1
    stride = max(2, math.ceil(numel / budget))
    last = shape[-1] if shape else 1
    while not _is_prime(stride) or last % stride == 0:
        stride += 1
    return stride


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def squared_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squared entries of each tensor, as one vector (float32, or float64 if a tensor is),
    on the first tensor's device. The square root of a block's sum is its L2 norm; squares,
    unlike norms, add up across shards.

    Of a DTensor (FSDP2), its local shard's, weighted by `shard_share`: summed over ranks,
    the whole tensor's; of a sparse tensor (an ``nn.Embedding(sparse=True)`` gradient), its
    values'.
    """
    tensors = [t.coalesce().values() if t.is_sparse else t for t in tensors]
    shares = None
    dtensor = _dtensor_type()
    if dtensor is not None and any(isinstance(t, dtensor) for t in tensors):
        shares = [shard_share(t) for t in tensors]
        tensors = [local(t) for t in tensors]
    wide = None if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    norms = torch._foreach_norm(list(tensors), 2, dtype=wide)
    if shares is not None and any(share != 1.0 for share in shares):
        norms = torch._foreach_mul(norms, [math.sqrt(share) for share in shares])
    device = norms[0].device
    return torch.stack([n if n.device == device else n.to(device) for n in norms]).pow(2)


# Tensors of at most this many entries are reduced by shape (`ByShape`): a CPU spends a few
# microseconds on each call, most of a small tensor's cost, and a large one's arithmetic outweighs
# its call. The stacked copy of a group is as large as the group's tensors.
SMALL_NUMEL = 1 << 14


class ByShape:
    """A fixed list of tensors (a model's parameters, or their gradients, in the same order)
    reduced by shape: the small plain tensors of one shape, dtype and device in one call on
    their stacked copy, every other one (large, float64, a DTensor) as `squared_norms` does.

    Host work then grows with the number of shapes, not of tensors: a 48-block stack's 194
    parameters are 2 groups. Results come in the list's order.
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], groupable: Sequence[bool] | None = None
    ) -> None:
        """``groupable``: which tensors may join a group (all by default)."""
        self.count = len(tensors)
        by_key: dict[tuple[object, ...], list[int]] = {}
        for i, t in enumerate(tensors):
            small = t.numel() <= SMALL_NUMEL and t.dtype != torch.float64
            plain = type(t) in (torch.Tensor, torch.nn.Parameter)  # no DTensor, no subclass
            if small and plain and (groupable is None or groupable[i]):
                by_key.setdefault((t.shape, t.dtype, t.device), []).append(i)
        self.groups = [group for group in by_key.values() if len(group) > 1]
        grouped = {i for group in self.groups for i in group}
        self.alone = [i for i in range(self.count) if i not in grouped]
        wide = any(tensors[i].dtype == torch.float64 for i in self.alone)
        self.dtype = torch.float64 if wide else torch.float32
        self._positions: dict[torch.device, list[torch.Tensor]] = {}

    @torch.no_grad()
    def squared_norms(
        self, tensors: Sequence[torch.Tensor | None], device: torch.device
    ) -> torch.Tensor:
        """`squared_norms` of ``tensors`` (None: 0), one value each on ``device``."""
        out = torch.zeros(self.count, dtype=self.dtype, device=device)
        positions = self._positions_on(device)
        for group, where in zip(self.groups, positions, strict=False):
            members = [tensors[i] for i in group]
            present = [t for t in members if t is not None]
            if len(present) < len(members):  # gradients not made yet: 0
                if not present:
                    continue
                where = torch.tensor([i for i in group if tensors[i] is not None], device=device)
            try:
                squares = _row_squares(torch.stack(present))
            except RuntimeError:  # a tensor changed shape since (FSDP1 swaps shards and wholes)
                squares = squared_norms(present)
            out.index_copy_(0, where, squares.to(device, self.dtype))
        alone = [(i, t) for i in self.alone if (t := tensors[i]) is not None]
        if alone:
            if len(alone) < len(self.alone):
                where = torch.tensor([i for i, _ in alone], device=device)
            else:
                where = positions[-1]
            squares = squared_norms([t for _, t in alone])
            out.index_copy_(0, where, squares.to(device, self.dtype))
        return out

    @torch.no_grad()
    def copies(self, tensors: Sequence[torch.Tensor], strides: Sequence[int]) -> list[torch.Tensor]:
        """What `change_squares` compares against once ``tensors`` changed: a stacked copy of
        each group (whose strides must be 1), then `strided_samples` of the others."""
        groups = [torch.stack([tensors[i] for i in group]) for group in self.groups]
        alone = [tensors[i] for i in self.alone]
        return groups + strided_samples(alone, [strides[i] for i in self.alone])

    @torch.no_grad()
    def copy_squares(self, copies: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per tensor, in float32, the sum of squares of what `copies` holds of it (of the
        strided sample, for a tensor alone with a stride above 1)."""
        device = copies[0].device
        squares = torch.zeros(self.count, device=device)
        positions = self._positions_on(device)
        for before, where in zip(copies[: len(self.groups)], positions, strict=False):
            squares.index_copy_(0, where, _row_squares(before).to(device))
        if self.alone:
            alone = squared_norms(list(copies[len(self.groups) :]))
            squares.index_copy_(0, positions[-1], alone.to(device, torch.float32))
        return squares

    @torch.no_grad()
    def change_squares(
        self,
        tensors: Sequence[torch.Tensor],
        strides: Sequence[int],
        copies: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Per tensor, in float32, the sum of squares of its change since `copies` was taken
        (of the strided sample, for a tensor alone with a stride above 1)."""
        device = copies[0].device
        change = torch.zeros(self.count, device=device)
        positions = self._positions_on(device)
        for group, before, where in zip(self.groups, copies, positions, strict=False):
            now = torch.stack([tensors[i] for i in group])
            change.index_copy_(0, where, _row_squares(now.sub_(before)).to(device))
        if self.alone:
            before_alone = list(copies[len(self.groups) :])
            views = strided_views(
                [tensors[i] for i in self.alone], [strides[i] for i in self.alone]
            )
            moved = squared_norms(torch._foreach_sub(views, before_alone))
            change.index_copy_(0, positions[-1], moved.to(device, torch.float32))
        return change

    def _positions_on(self, device: torch.device) -> list[torch.Tensor]:
        """Each group's positions as an index tensor on ``device``, then the others' (made
        once per device)."""
        if device not in self._positions:
            lists = [*self.groups, self.alone]
            self._positions[device] = [torch.tensor(p, device=device) for p in lists]
        return self._positions[device]


def _row_squares(stacked: torch.Tensor) -> torch.Tensor:
    """The sum of squares of each tensor stacked along the first axis, in float32."""
    rows = stacked.reshape(len(stacked), -1)
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).pow_(2)


# `SquareSums` reads a sampled tensor in runs of this many consecutive entries: 64 bytes of
# float32, one cache line. Single entries at a stride of 16 floats or more would each cost a
# whole line: as much memory traffic as reading the tensor whole.
CHUNK = 16


class SquareSums:
    """Sums of squared entries of a fixed list of tensors on one device (a model's gradients,
    new tensors each step, given in the same order; None counts 0), each read whole or, past
    ``sample`` entries, estimated from a fixed sample of about ``sample`` of them.

    The sample of a tensor is a run of `CHUNK` consecutive entries (in memory order) every
    ``CHUNK * q`` entries, ``q`` prime to a row's length (the entries past the first axis) so
    that the runs walk through all columns rather than repeat a few; its sum of squares times
    numel / entries read estimates the tensor's. The positions are the same at every step.
    The plain tensors read whole of at most `SMALL_NUMEL` entries are concatenated, reduced in
    one call (a CPU spends microseconds on each call); the others (larger, a DTensor, a
    subclass) are read as `squared_norms` does. Results come in float32, in the order of
    `order` (positions in the list).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        sample: int | None,
        whole: Sequence[bool] | None = None,
    ) -> None:
        """``whole``: which tensors to read whole whatever their size, as `squared_norms` does
        (the gradient of an embedding table: a few rows, which a sample would mostly miss, or
        a sparse tensor)."""
        plain = [type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors]
        runs = []
        for i, t in enumerate(tensors):
            if plain[i] and sample is not None and t.numel() > sample and not (whole and whole[i]):
                period = CHUNK * _run_period(t.numel(), t.numel() // len(t), sample)
                runs.append((i, (1 + (t.numel() - CHUNK) // period, CHUNK), (period, 1)))
        sampled = {i for i, _, _ in runs}
        joined = [
            i
            for i, t in enumerate(tensors)
            if plain[i]
            and i not in sampled
            and t.numel() <= SMALL_NUMEL
            and not (whole and whole[i])
        ]
        self.alone = [i for i in range(len(tensors)) if i not in sampled and i not in joined]
        self.order = joined + [i for i, _, _ in runs] + self.alone
        self.joined = [(i, tensors[i].dim() != 1, tensors[i].numel()) for i in joined]
        self.runs = runs
        self.sampled = [i for i, _, _ in runs]  # the positions of the tensors sampled
        device = tensors[0].device
        self._lengths = torch.tensor([n for _, _, n in self.joined], device=device)
        self._rows = torch.tensor([size[0] for _, size, _ in runs], device=device)
        self._scales = torch.tensor(
            [tensors[i].numel() / (size[0] * CHUNK) for i, size, _ in runs], device=device
        )
        self._zeros: dict[int, torch.Tensor] = {}
        self._device = device

    def __call__(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The sums (estimates of the sampled ones) of ``tensors`` in the order `order`; under
        ``torch.no_grad()`` for gradients made with ``create_graph``."""
        parts = []
        if self.joined:
            flat = torch.cat(
                [
                    self._zero(n) if (t := tensors[i]) is None else t.reshape(-1) if nd else t
                    for i, nd, n in self.joined
                ]
            )
            flat = flat if flat.dtype == torch.float64 else flat.float()
            # unsafe: the lengths are right by construction; checking them reads them back
            parts.append(
                torch.segment_reduce(flat * flat, "sum", lengths=self._lengths, unsafe=True).float()
            )
        if self.runs:
            runs = torch.cat(
                [
                    self._zero(size[0] * CHUNK).view(size)
                    if (t := tensors[i]) is None
                    else t.as_strided(size, stride, t.storage_offset())
                    if t.is_contiguous()
                    else _runs(t, size, stride)
                    for i, size, stride in self.runs
                ]
            )
            runs = runs if runs.dtype == torch.float64 else runs.float()
            rows = torch.linalg.vecdot(runs, runs)
            squares = torch.segment_reduce(rows, "sum", lengths=self._rows, unsafe=True).float()
            parts.append(squares.mul_(self._scales))
        if self.alone:  # a missing gradient as a one-entry zero
            none = self._zero(1)
            alone = [none if (t := tensors[i]) is None else t for i in self.alone]
            parts.append(squared_norms(alone).float())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _zero(self, numel: int) -> torch.Tensor:
        if numel not in self._zeros:
            self._zeros[numel] = torch.zeros(numel, device=self._device)
        return self._zeros[numel]


def _run_period(numel: int, row: int, sample: int) -> int:
    """``q`` for `SquareSums`: at least numel / ``sample`` (at most ``sample`` entries read)
    and prime to ``row``."""
    q = max(2, math.ceil(numel / sample))
    while math.gcd(q, row) != 1:
        q += 1
    return q


def _runs(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """The runs of entries `SquareSums` reads of a tensor that is not contiguous, in memory
    order: a view when it fills its memory in a permuted order (channels_last), else runs of
    a contiguous copy."""
    by_stride = sorted(range(t.dim()), key=lambda d: -t.stride()[d])
    if not t.permute(by_stride).is_contiguous():
        t = t.contiguous()
    return t.as_strided(size, stride, t.storage_offset())


def group_sums(values: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    """``out[g]``: the sum of the ``values[i]`` with ``index[i] == g``, for ``g < groups``."""
    return values.new_zeros(groups).index_add_(0, index, values)


def strided_views(tensors: Sequence[torch.Tensor], strides: Sequence[int]) -> list[torch.Tensor]:
    """Every ``stride``-th entry of each tensor (flattened), as views (no copy)."""
    shards = [local(t).detach() for t in tensors]  # a DTensor's (FSDP2) local shard
    return [t if s == 1 else t.reshape(-1)[::s] for t, s in zip(shards, strides, strict=True)]


def strided_samples(tensors: Sequence[torch.Tensor], strides: Sequence[int]) -> list[torch.Tensor]:
    """Copies of `strided_views`: what `ByShape.change_squares` compares against."""
    return [view.clone() for view in strided_views(tensors, strides)]


def logit_stats(logits: torch.Tensor) -> torch.Tensor:
    """(max |logit|, RMS, mean log-sum-exp over the last axis) of output logits.

    The mean log-sum-exp is the "z" that z-loss keeps near 0.
    """
    x = logits.detach().float()
    return torch.stack([x.abs().amax(), rms(x), torch.logsumexp(x, dim=-1).mean()])


def abs_max(scores: torch.Tensor) -> torch.Tensor:
    """max |s| over attention logits, as float32 (a max is exact in the logits' own dtype, so
    no float32 copy of them is made)."""
    low, high = torch.aminmax(scores.detach())
    return torch.maximum(high, -low).float()


def head_abs_max(scores: torch.Tensor, heads: int) -> torch.Tensor:
    """max |s| of each of ``heads`` heads over attention logits (..., queries, keys), as float32.

    The dims before the last two are flattened; their index modulo ``heads`` is the head, which
    holds for (batch, heads, ...) and for (batch * heads, ...) alike. When they do not split
    into ``heads`` (a layout discovery could not read), every head gets the overall max.
    """
    s = scores.detach()
    if s.ndim < 2:
        return abs_max(s).expand(heads)
    dims = (-2, -1)
    per_slice = torch.maximum(s.amax(dim=dims), -s.amin(dim=dims)).float().reshape(-1)
    if per_slice.numel() % heads:
        return per_slice.amax().expand(heads)
    return per_slice.view(-1, heads).amax(dim=0)


SAMPLE_SHARE = 8  # the logit max forms the logits of 1 query row in 8 with every key, and of
SAMPLE_ROWS = 64  # 1 key in 8 with every query; at least 64 of each per sequence and head
# (so sequences up to 128 tokens are formed whole: on a CPU, below 256 tokens the sample's
# selection costs about what the products it saves did)


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(-2, index.expand(*index.shape[:-1], x.shape[-1]))


def logit_sample(query: torch.Tensor, key: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs (queries, keys) whose products `sdpa_logit_max` forms: ``[(query, key)]`` when that
    costs no more than the sample, else the queries with every key and every query with the
    keys, a `SAMPLE_SHARE`-th of each per sequence and head (at least `SAMPLE_ROWS`).

    The keys taken are those farthest from the mean key m (an attention sink, an outlier); for
    the rest, |q . k| <= |q . m| + |q| r, r the largest distance |k - m| left, and the queries
    taken are those with the largest such bound. ``key`` may have fewer heads than ``query``
    (grouped-query attention).
    """
    t_q, t_k = query.shape[-2], key.shape[-2]
    rows = max(SAMPLE_ROWS, -(-t_q // SAMPLE_SHARE))
    cols = max(SAMPLE_ROWS, -(-t_k // SAMPLE_SHARE))
    if rows * t_k + t_q * cols >= t_q * t_k:
        return [(query, key)]
    mean = key.mean(dim=-2, keepdim=True)
    far = torch.linalg.vector_norm(key - mean, dim=-1, keepdim=True).topk(cols + 1, dim=-2)
    radius = far.values[..., cols:, :]  # the largest distance among the keys not taken
    if min(query.ndim, key.ndim) >= 3 and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        mean, radius = (t.repeat_interleave(group, dim=-3) for t in (mean, radius))
    bound = (query @ mean.transpose(-1, -2)).abs()  # (..., queries, 1)
    bound += torch.linalg.vector_norm(query, dim=-1, keepdim=True) * radius
    index = bound.topk(rows, dim=-2, sorted=False).indices
    return [(_rows(query, index), key), (query, _rows(key, far.indices[..., :cols, :]))]


def sdpa_logit_max(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float | None = None,
    heads: int | None = None,
    chunk_elements: int = 1 << 22,
) -> torch.Tensor:
    """max |q . k| * scale of each query head over the logits ``scaled_dot_product_attention``
    forms, over the products `logit_sample` picks: a vector of ``heads`` values (default:
    ``query.shape[-3]``, 1 for 2-D queries). A lower bound of the max over every product,
    exact for short sequences (up to 2 * `SAMPLE_ROWS` queries and keys).

    Every q . k product counts, masks (``attn_mask``, ``is_causal``) left out as they are in
    eager attention, where the max is taken before a mask meets the logits. The logits are
    materialized in float32 a block of query rows at a time, so memory stays near
    ``chunk_elements`` floats whatever the sequence length. Grouped-query attention (fewer key
    heads) serves each key head's queries together.
    """
    # contiguous: the matmuls and gathers of strided q and k (views of a fused qkv) copy them
    q, k = query.detach().float().contiguous(), key.detach().float().contiguous()
    if heads is None:
        heads = q.shape[-3] if q.ndim >= 3 else 1
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    best = torch.zeros(heads, device=q.device)
    for qs, ks in logit_sample(q, k):
        best = torch.maximum(best, _products_max(qs, ks, heads, chunk_elements))
    return best * abs(scale)


def _products_max(q: torch.Tensor, k: torch.Tensor, heads: int, chunk: int) -> torch.Tensor:
    """max |q . k| of each head, ``chunk`` products at a time."""
    group = q.shape[-3] // k.shape[-3] if min(q.ndim, k.ndim) >= 3 else 1
    t_q, t_k = q.shape[-2], k.shape[-2]
    rows_per_chunk = max(1, chunk // max(1, q[..., :1, :1].numel() * t_k))
    best = torch.zeros(heads, device=q.device)
    kt = k.transpose(-1, -2)
    for start in range(0, t_q, rows_per_chunk):
        block = q[..., start : start + rows_per_chunk, :]
        if group > 1:  # (..., k_heads * group, rows, d) as (..., k_heads, group * rows, d)
            shape = block.shape
            block = block.reshape(*shape[:-3], k.shape[-3], -1, shape[-1])
            s = (block @ kt).view(*shape[:-1], t_k)
        else:
            s = block @ kt  # unscaled: max |s c| = |c| max |s|
        best = torch.maximum(best, head_abs_max(s, heads))
    return best


def mha_qk(
    query: torch.Tensor,
    key: torch.Tensor,
    num_heads: int,
    w_q: torch.Tensor,
    b_q: torch.Tensor | None,
    w_k: torch.Tensor,
    b_k: torch.Tensor | None,
    bias_k: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries and keys ``F.multi_head_attention_forward`` forms, float32, each (batch,
    heads, sequence, head_dim).

    ``query`` and ``key`` are (sequence, batch, features) or unbatched (sequence, features);
    q = query w_q^T + b_q and k = key w_k^T + b_k are split into ``num_heads`` heads, with
    ``bias_k`` appended as one more key, or ``static_k`` (batch * heads, keys, head_dim) taken
    as the keys.
    """

    def project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        x = x.detach().float()
        x = x.unsqueeze(1) if x.ndim == 2 else x
        return F.linear(x, w.detach().float(), None if b is None else b.detach().float())

    q = project(query, w_q, b_q)
    head_dim = q.shape[-1] // num_heads
    q = q.reshape(q.shape[0], q.shape[1], num_heads, head_dim).permute(1, 2, 0, 3)
    if static_k is not None:
        k = static_k.detach().float().reshape(q.shape[0], num_heads, -1, head_dim)
    else:
        k = project(key, w_k, b_k)
        if bias_k is not None:
            k = torch.cat([k, bias_k.detach().float().expand(1, k.shape[1], -1)])
        k = k.reshape(k.shape[0], k.shape[1], num_heads, head_dim).permute(1, 2, 0, 3)
    return q, k


def mha_logit_max(
    query: torch.Tensor,
    key: torch.Tensor,
    num_heads: int,
    w_q: torch.Tensor,
    b_q: torch.Tensor | None,
    w_k: torch.Tensor,
    b_k: torch.Tensor | None,
    bias_k: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    chunk_elements: int = 1 << 22,
) -> torch.Tensor:
    """max |q . k| / sqrt(head_dim) of each of the ``num_heads`` heads over the logits
    ``F.multi_head_attention_forward`` forms, q and k as `mha_qk` makes them. Masks are
    additive or exclude positions the model still forms logits for: they are ignored. Over the
    products of `logit_sample`, materialized a block at a time, as in `sdpa_logit_max`.
    """
    q, k = mha_qk(query, key, num_heads, w_q, b_q, w_k, b_k, bias_k, static_k)
    return sdpa_logit_max(q, k, heads=num_heads, chunk_elements=chunk_elements)


def batchnorm_stats(
    x: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """How far a batch is from a BatchNorm's running statistics, and what that does.

    Returns float32 (mean_drift, var_drift, train_eval_gap):

    * mean_drift: mean over channels of |mu_batch - mu_run| / sqrt(var_run + eps);
    * var_drift: mean over channels of |log((var_batch + eps) / (var_run + eps))|;
    * train_eval_gap: RMS(y_train - y_eval) / RMS(y_train), where y_train normalizes the batch
      with its own statistics (train mode) and y_eval with the running ones (eval mode).
    """
    xf = x.detach().float()
    dims = [d for d in range(xf.ndim) if d != 1]
    mean_b = xf.mean(dim=dims)
    var_b = xf.var(dim=dims, unbiased=False)
    mean_r, var_r = running_mean.detach().float(), running_var.detach().float()
    mean_drift = ((mean_b - mean_r).abs() / (var_r + eps).sqrt()).mean()
    var_drift = ((var_b + eps) / (var_r + eps)).log().abs().mean()
    w = None if weight is None else weight.detach().float()
    b = None if bias is None else bias.detach().float()
    y_train = F.batch_norm(xf, None, None, w, b, training=True, eps=eps)
    y_eval = F.batch_norm(xf, mean_r, var_r, w, b, training=False, eps=eps)
    gap = rms(y_train - y_eval) / rms(y_train).clamp_min(1e-30)
    return torch.stack([mean_drift, var_drift, gap])


def gain_stats(weight: torch.Tensor, offset: float | torch.Tensor = 0.0) -> torch.Tensor:
    """(mean, std) along the last axis of a norm's effective gain ``offset + weight`` (Gemma:
    offset 1); for stacked ``(n, C)`` weights and ``(n,)`` offsets, one row per norm."""
    g = weight.detach().float()
    return torch.stack([g.mean(dim=-1) + offset, g.std(dim=-1, unbiased=False)], dim=-1)


def finite_sum(x: torch.Tensor) -> torch.Tensor:
    """The float32 sum of ``x``: NaN or Inf exactly when ``x`` holds one.

    One pass, read back with the step's other statistics (a sum overflows only for entries
    near 1e38 / numel, far past any trained network's activations).
    """
    return x.detach().sum(dtype=torch.float32)


def finite_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`finite_sum` of each tensor, as one vector: NaN or Inf exactly where a tensor holds one."""
    return _stacked([finite_sum(t) for t in tensors])


def loglog_slope(values: Sequence[float]) -> float:
    """Least-squares slope of log(value) against log(depth) for depths 1..L (host floats).

    Pre-LN's sqrt(l) residual growth gives 0.5; a flat profile gives 0.
    """
    points = [(math.log(i + 1), math.log(v)) for i, v in enumerate(values) if v > 0]
    if len(points) < 2:
        return float("nan")
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / sxx


# The median |x| of `outlier_parts` is taken over an evenly strided sample of at most this many
# entries (all of them in smaller tensors): a sort of a whole stream costs a block's forward, and
# the median of 2,048 entries of a Gaussian stream is within about 3% (one standard error) of
# the whole stream's, where the ratio it divides is flagged at 100x.
MEDIAN_SAMPLE = 2048


OutlierParts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def outlier_parts(x: torch.Tensor) -> OutlierParts:
    """What `outlier_stats_many` needs of an activation with ``C`` channels along
    `feature_dim`: each channel's max, min and sum of squares over all other positions (three
    ``C``-vectors), and a copy of an evenly strided sample of at most `MEDIAN_SAMPLE` entries,
    whose median nonzero |x| `outlier_stats_many` takes (for many activations in one call).

    Reduced in float32 or wider; the max and min are exact in ``x``'s own dtype.
    """
    x = x.detach()
    if x.ndim == 1:
        x = x.unsqueeze(0)  # one position
    wide, dim = _wide(x), feature_dim(x) % x.ndim
    stride = sample_stride(x.shape, MEDIAN_SAMPLE)
    sample = x.reshape(-1)[::stride].to(wide, copy=True)  # a copy: x may change in place later
    if x.dtype != wide:
        x = x.to(wide)
    if dim == x.ndim - 1:  # channels last: one row per position
        rows = x.reshape(-1, x.shape[-1])
        return rows.amax(dim=0), rows.amin(dim=0), torch.linalg.vecdot(rows, rows, dim=0), sample
    others = [d for d in range(x.ndim) if d != dim]
    return x.amax(dim=others), x.amin(dim=others), x.square().sum(dim=others), sample


def outlier_stats_many(
    highest: torch.Tensor, lowest: torch.Tensor, power: torch.Tensor, sample: torch.Tensor
) -> torch.Tensor:
    """(max |x| / median nonzero |x|, the channel holding that max, the kurtosis of the
    channels' RMS) from `outlier_parts`, as float32: three values, or ``(n, 3)`` for the parts
    of ``n`` activations stacked (channels and sampled entries along the last axis).

    The ratio's median is of the sample's nonzero |x| (the whole tensor up to `MEDIAN_SAMPLE`
    entries; torch's median, the lower middle value of an even count); the ratio is NaN when no
    sampled entry is nonzero.
    The channel is the first holding the largest |x|. With s_j the RMS of channel j over all
    other positions, the kurtosis mean(s^4) / mean(s^2)^2 is 1 when every channel has the same
    RMS and the number of channels when one holds everything.
    """
    top, channel = torch.maximum(highest, -lowest).max(dim=-1)
    magnitude = sample.abs()
    median = magnitude.masked_fill_(magnitude == 0, math.nan).nanmedian(dim=-1).values
    # the sums of squares scaled by the largest, so that their squares cannot overflow float32
    power = power / power.amax(dim=-1, keepdim=True)
    kurtosis = power.pow(2).mean(dim=-1) / power.mean(dim=-1).pow(2)
    stats = [top / median, channel.to(top.dtype), kurtosis]
    return torch.stack(stats, dim=-1).float()


def outlier_stats(x: torch.Tensor) -> torch.Tensor:
    """`outlier_stats_many` of one activation: (ratio, channel, kurtosis)."""
    return outlier_stats_many(*outlier_parts(x))
