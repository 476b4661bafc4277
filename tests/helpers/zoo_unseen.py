"""Architectures from model libraries no other zoo builds: vit-pytorch, x-transformers, pytorchcv,
diffusers and open_clip, with ground truth derived from their source (issue 25, "go beyond your
zoo").

Every builder makes a tiny model from constructor arguments (random weights, nothing is
downloaded; the caller runs ``torch.manual_seed(0)`` and ``model.eval()``) and returns it with
example inputs and an ``Expected`` (conventions in ``zoo.py`` and ``zoo_vision.py``).
The expectations are what the source computes, not what discovery printed: many maps are wrong
today, and ``XFAIL`` names each (model, check) that fails and the class of issue 25 it falls
under, so the tests turn red (strict xfail) the day discovery gets it right.

Line numbers refer to vit-pytorch 1.26.14, x-transformers 2.31.10, pytorchcv 0.0.74, diffusers
0.42.1 and open_clip_torch 3.3.0 under ``site-packages``. Conventions beyond ``zoo.py``:

* A block is what GPT-2's and DeepNorm's N counts: one attention and one feed-forward branch
  (plus what repeats with them). Where the library keeps each sublayer in its own container
  (x-transformers' ``layers = ModuleList([ModuleList([norms, branch, Residual()]), ...])``) or
  unpacks a pair (``for attn, ff in self.layers``), the stack's depth is the number of such
  repeats, whatever discovery names its blocks.
* Adds performed by a parent that unpacks its blocks (``x = attn(x) + x`` in
  ``Transformer.forward``) are keyed by that parent: ``"transformer#0"`` is the first add of the
  call, in execution order.
* A norm is the outermost module whose whole computation is the normalization and its gain and
  bias (x-transformers' ``LayerNorm`` wrapping a parameter-free ``nn.LayerNorm`` is one norm); a
  module that also computes other things (diffusers' ``AdaLayerNormZero``, which embeds the
  condition and returns gates) is not a norm, its inner ``nn.LayerNorm`` is.
* A stem's ``Sequential`` of two convolutions is not a stack (no blocks, no adds).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from zoo import Expected

__all__ = ["BUILDERS", "XFAIL"]

_Built = tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]

VOCAB = 128
SEQ = 16


def _image(batch: int = 1, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ))


# --------------------------------------------------------------------------------------------
# vit-pytorch (lucidrains): blocks unpacked by the parent
# --------------------------------------------------------------------------------------------


# vit-pytorch ViT (vit_pytorch/vit.py), image 32, patch 8, dim 32, depth 3, 2 heads of 16:
# - Transformer L70-76 `self.layers = ModuleList([ModuleList([Attention, FeedForward])])` and
#   L79-81 `for attn, ff in self.layers: x = attn(x) + x; x = ff(x) + x`: the adds are made by
#   `transformer` itself (keys transformer#0..5), the blocks are unpacked (issue 25 class 2).
# - Norms (nn.LayerNorm): Attention L39 `self.norm` (3) and FeedForward L19 `net.0` (3), each the
#   first op of its branch -> pre (6); Transformer L69 `self.norm`, L83 after the loop -> final;
#   patch embedding L101 and L103 -> other (2). Total 9.
# - Writers: Attention L46-49 `to_out = Sequential(Linear, Dropout)` -> to_out.0; FeedForward
#   L23 `net.4`. Stack: transformer.layers, 3 blocks, pre-ln, all 6 adds.
# - Attention: L57-59 `matmul(q, k^T) * scale` then `self.attend` (nn.Softmax) -> 3, eager.
#   Head: L116 `mlp_head`.
def build_vit() -> _Built:
    from vit_pytorch.vit import ViT

    model = ViT(
        image_size=32, patch_size=8, num_classes=10, dim=32, depth=3, heads=2, dim_head=16,
        mlp_dim=64,
    )  # fmt: skip
    exp = Expected(
        norms={"layernorm": 9},
        roles={"pre": 6, "final": 1, "other": 2},
        stacks={"transformer.layers": (3, "pre-ln")},
        adds_per_stack={"transformer.layers": 6},
        residual_adds=6,
        attention=3,
        head="mlp_head",
        writers={
            "transformer#0": ("transformer.layers.0.0.to_out.0",),
            "transformer#1": ("transformer.layers.0.1.net.4",),
            "transformer#2": ("transformer.layers.1.0.to_out.0",),
            "transformer#5": ("transformer.layers.2.1.net.4",),
        },
    )
    return model, (_image(),), {}, exp


# vit-pytorch CaiT (vit_pytorch/cait.py), image 32, patch 8, dim 32, depth 3, cls_depth 2:
# - Transformer L112-115 `ModuleList([LayerScale(Attention), LayerScale(FeedForward)])` per
#   layer, L119-121 `for attn, ff in layers: x = attn(x, context) + x; x = ff(x) + x`: adds by
#   `patch_transformer` (#0..5) and `cls_transformer` (#0..3); LayerScale L45
#   `self.fn(x) * self.scale` (a (1, 1, dim) parameter at 0.1, L34-42) scales the branch.
# - Norms (nn.LayerNorm): Attention L68 `norm` and FeedForward L51 `net.0`, 2 per layer x 5
#   layers -> pre (10); patch embedding L148, L150 -> other (2); L162 `mlp_head.0` reads the class
#   token after the last cls layer -> final (1). Total 13.
# - Writers: Attention L78 `to_out.0`, FeedForward L55 `net.4` (under LayerScale's `fn`).
# - Stacks: patch_transformer.layers (3 blocks) and cls_transformer.layers (2), pre-ln.
# - Attention: L92 `einsum(q, k) * scale`, L94 talking heads `einsum(dots,
#   mix_heads_pre_attn)` (a (heads, heads) parameter mixing heads before the softmax), L96
#   `self.attend` -> 5 modules, eager. Head: L163 `mlp_head.1`.
def build_cait() -> _Built:
    from vit_pytorch.cait import CaiT

    model = CaiT(
        image_size=32, patch_size=8, num_classes=10, dim=32, depth=3, cls_depth=2, heads=2,
        dim_head=16, mlp_dim=64,
    )  # fmt: skip
    p, c = "patch_transformer.layers", "cls_transformer.layers"
    exp = Expected(
        norms={"layernorm": 13},
        roles={"pre": 10, "other": 2, "final": 1},
        stacks={p: (3, "pre-ln"), c: (2, "pre-ln")},
        adds_per_stack={p: 6, c: 4},
        residual_adds=10,
        attention=5,
        head="mlp_head.1",
        writers={
            "patch_transformer#0": (f"{p}.0.0.fn.to_out.0",),
            "patch_transformer#1": (f"{p}.0.1.fn.net.4",),
            "cls_transformer#0": (f"{c}.0.0.fn.to_out.0",),
            "cls_transformer#3": (f"{c}.1.1.fn.net.4",),
        },
    )
    return model, (_image(),), {}, exp


# vit-pytorch MaxViT (vit_pytorch/max_vit.py), dim 16, depth (2, 1), dim_head 8, window 4, 32x32:
# - L243-275: one flat `self.layers = ModuleList` of 3 blocks (2 in stage 1, 1 in stage 2), each
#   `Sequential(MBConv, Rearrange, Residual(Attention), Residual(FeedForward), Rearrange,
#   Rearrange, Residual(Attention), Residual(FeedForward), Rearrange)`; L288-289 run them in a
#   chain. MBConv (L90-117) is a plain Sequential for the first block of a stage (downsample)
#   and `MBConvResidual` (L65-74, `out + x`) otherwise: only layers.1.0 adds.
# - Adds: Residual L27-28 `self.fn(x) + x` at layers.K.{2,3,6,7} (12) and MBConvResidual L74 at
#   layers.1.0 (1) -> 13, all in the stack `layers` (3 blocks, pre-ln: the transformer adds are
#   pre-norm, the MBConv add's norms are in its branch). The MBConv blocks' runs of Residual
#   children (layers.K[2..7]) are sublayers, not a stack (issue 25 class 11).
# - Norms: LayerNorm in Attention L135 and FeedForward L35, 4 per block -> pre (12); L281
#   `mlp_head.1` after mean pooling -> final (1); 13 layernorm. BatchNorm2d L104, L107, L111: 3 per
#   MBConv; layers.1.0's sit in a residual branch -> branch (3); layers.0.0's and layers.2.0's are
#   on no residual branch -> other (6); 9 batchnorm.
# - Writers: Attention L143-146 `to_out.0`; FeedForward L39 `net.4`; MBConv L110 `fn.7` (the
#   squeeze-excitation Linear layers L52-58 gate it, L62 `x * self.gate(x)`).
# - Attention: L184 einsum, L189 `+ bias`, L193 `self.attend` (Sequential(Softmax, Dropout))
#   -> 6, eager. Head: L282 `mlp_head.2`. The stem L230-233 (two Conv2d) is no stack.
def build_maxvit() -> _Built:
    from vit_pytorch.max_vit import MaxViT

    model = MaxViT(num_classes=10, dim=16, depth=(2, 1), dim_head=8, window_size=4, dropout=0.0)
    exp = Expected(
        norms={"layernorm": 13, "batchnorm": 9},
        roles={"pre": 12, "final": 1, "branch": 3, "other": 6},
        stacks={"layers": (3, "pre-ln")},
        adds_per_stack={"layers": 13},
        residual_adds=13,
        attention=6,
        head="mlp_head.2",
        writers={
            "layers.0.2#0": ("layers.0.2.fn.to_out.0",),
            "layers.0.3#0": ("layers.0.3.fn.net.4",),
            "layers.0.6#0": ("layers.0.6.fn.to_out.0",),
            "layers.0.7#0": ("layers.0.7.fn.net.4",),
            "layers.1.0#0": ("layers.1.0.fn.7",),
        },
        gates={"layers.1.0#0": ("layers.1.0.fn.6.gate.3",)},
    )
    return model, (_image(),), {}, exp


# vit-pytorch parallel ViT (vit_pytorch/parallel_vit.py), dim 32, depth 3, 2 parallel branches:
# - Parallel L19-20 `sum([fn(x) for fn in self.fns])`; Transformer L78-82 `ModuleList([Parallel(2
#   x Attention), Parallel(2 x FeedForward)])` per layer, L85-87 `x = attns(x) + x; x = ffs(x) +
#   x`: 6 adds by `transformer`, each with two writers summed side by side -> parallel.
# - Norms (nn.LayerNorm): Attention L45 `norm`, FeedForward L26 `net.0`, one per branch: 3 x 2 x
#   2 -> pre (12); L117 `mlp_head.0` on the class token -> final. Total 13 (no embedding norm).
# - Writers: Attention L51-54 `to_out.0`, FeedForward L30 `net.4`, in branch order.
# - Stack: transformer.layers, 3 blocks, parallel. Attention: 6 (L61-63), eager. Head L118.
def build_parallel_vit() -> _Built:
    from vit_pytorch.parallel_vit import ViT

    model = ViT(
        image_size=32, patch_size=8, num_classes=10, dim=32, depth=3, heads=2, dim_head=16,
        mlp_dim=64, num_parallel_branches=2,
    )  # fmt: skip
    b = "transformer.layers"
    exp = Expected(
        norms={"layernorm": 13},
        roles={"pre": 12, "final": 1},
        stacks={b: (3, "parallel")},
        adds_per_stack={b: 6},
        residual_adds=6,
        attention=6,
        head="mlp_head.1",
        writers={
            "transformer#0": (f"{b}.0.0.fns.0.to_out.0", f"{b}.0.0.fns.1.to_out.0"),
            "transformer#1": (f"{b}.0.1.fns.0.net.4", f"{b}.0.1.fns.1.net.4"),
            "transformer#5": (f"{b}.2.1.fns.0.net.4", f"{b}.2.1.fns.1.net.4"),
        },
    )
    return model, (_image(),), {}, exp


# vit-pytorch ViT with KEEL post-LN (vit_pytorch/vit_with_keel_post_ln.py), dim 32, depth 3:
# - Transformer L88-93 `self.layers.extend([Attention, FeedForward])`: one flat ModuleList of
#   alternating sublayers, no container per block (class 2); L99 `post_norms = ModuleList(2 x
#   depth - 1 nn.LayerNorm)`, one norm after each add but the first, each at its own depth of
#   the stream: a stack of norms, as a list of per-layer norms zipped with a list of layers is
#   (5, post-ln; unlike one sublayer's pre and post norms kept in a list, class 3, which stand
#   at one depth). L104-117: `x = out + residual`
#   for the first sublayer, then `x = post_norm(out + residual * residual_scale)` with the
#   constant L97 `keel_residual_scale = 2 x depth` = 6 on the skip: 6 adds by `transformer`.
# - Norms (nn.LayerNorm): Attention L44 `norm`, FeedForward L27 `net.0` -> pre (6);
#   post_norms after each add but the first -> post (5); patch embedding L153, L155 -> other
#   (2). Total 13. Pre and post norms on the same adds -> mixed.
# - Writers: Attention L54-57 `to_out.0`, FeedForward L31 `net.4`. Stack: transformer.layers,
#   3 blocks of (Attention, FeedForward). Attention L65-67 -> 3, eager. Head: L176 `mlp_head`.
def build_keel_vit() -> _Built:
    from vit_pytorch.vit_with_keel_post_ln import ViT

    model = ViT(
        image_size=32, patch_size=8, num_classes=10, dim=32, depth=3, heads=2, dim_head=16,
        mlp_dim=64,
    )  # fmt: skip
    b = "transformer.layers"
    exp = Expected(
        norms={"layernorm": 13},
        roles={"pre": 6, "post": 5, "other": 2},
        stacks={b: (3, "mixed"), "transformer.post_norms": (5, "post-ln")},
        adds_per_stack={b: 6},
        residual_adds=6,
        attention=3,
        head="mlp_head",
        writers={
            "transformer#0": (f"{b}.0.to_out.0",),
            "transformer#1": (f"{b}.1.net.4",),
            "transformer#4": (f"{b}.4.to_out.0",),
            "transformer#5": (f"{b}.5.net.4",),
        },
    )
    return model, (_image(),), {}, exp


# --------------------------------------------------------------------------------------------
# x-transformers (lucidrains): one container per sublayer, norms kept in a list
# --------------------------------------------------------------------------------------------
#
# AttentionLayers (x_transformers/x_transformers.py L2761): L3205-3300 build, per sublayer
# ('a' attention, 'f' feed-forward, L3012-3020 `default_block = ('a', 'f')`, macaron prepends
# 'f'), `self.layers.append(ModuleList([norms, layer, residual]))` with L3288-3292 `norms =
# ModuleList([pre_branch_norm, post_branch_norm, post_main_norm])`. The forward (L3621-3729)
# unpacks them: `x = pre_norm(x)` (L3678), `out = block(x)` (L3700), `out =
# post_branch_norm(out)` (L3715), `x = residual_fn(out, inner_residual)` (L3717, Residual L1198-
# 1205 `x + residual`, the add made by `layers.K.2`), `x = post_main_norm(x)` (L3729); after the
# loop L3750 `x = final_norm(x)`. The norms default to `LayerNorm` (L1017-1036: a
# parameter-free nn.LayerNorm times `gamma + 1`, `norm_add_unit_offset=True` L2977-2979).
# Attention L2240 `to_out = LinearNoBias` writes; FeedForward L1823-1829 `ff = Sequential(proj_in,
# Dropout, proj_out)` (x-transformers' `Sequential` drops the Nones) -> `ff.2` writes. Attend
# (x_transformers/attend.py) L552 `einsum(q, k)`, L556 `* scale`, L561 `sim.clone()`, L596
# `masked_fill` (causal), L621 `self.attn_fn(sim)` (softmax): the attention module is
# `layers.K.1.attend`. TransformerWrapper: head `to_logits` (L4155-4160), no embedding norm.


def _xt_wrapper(attn_layers: nn.Module) -> nn.Module:
    from x_transformers import TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=SEQ, attn_layers=attn_layers)


def _xt_writers(layer: int, kind: str, prefix: str = "attn_layers.layers") -> tuple[str, ...]:
    branch = f"{prefix}.{layer}.1"
    return (f"{branch}.to_out",) if kind == "a" else (f"{branch}.ff.2",)


# x-transformers Decoder(dim 32, depth 2, 2 heads of 16), defaults (pre-norm):
# - layers 0..3 = a, f, a, f. Norms: 4 pre-branch LayerNorms (layers.K.0.0) -> pre; final_norm
#   -> final; 5 layernorm (their inner `ln` is part of each, issue 25 class 1).
# - Adds: layers.K.2#0 (4). Stack: attn_layers.layers, 2 blocks of (a, f), pre-ln (class 2).
def build_xt_decoder() -> _Built:
    from x_transformers import Decoder

    model = _xt_wrapper(Decoder(dim=32, depth=2, heads=2, attn_dim_head=16))
    s = "attn_layers.layers"
    exp = Expected(
        norms={"layernorm": 5},
        roles={"pre": 4, "final": 1},
        stacks={s: (2, "pre-ln")},
        adds_per_stack={s: 4},
        residual_adds=4,
        attention=2,
        head="to_logits",
        writers={f"{s}.{k}.2#0": _xt_writers(k, "af"[k % 2]) for k in range(4)},
    )
    return model, (_ids(),), {}, exp


# x-transformers Decoder(depth 3, sandwich_norm=True, use_rmsnorm=True, ff_glu=True):
# - L2975-2976 `RMSNorm` (L1076-1090: `F.normalize(x) * sqrt(dim) * (g + 1)`); L3286
#   `post_branch_norm = norm_fn() if sandwich_norm` normalizes the branch output before the add
#   (L3715). Norms: 6 pre (layers.K.0.0), 6 sandwich-post (layers.K.0.1), final -> 13 rmsnorm.
#   layers.K.0 (a ModuleList of the two norms) is no stack (class 3).
# - FeedForward with glu (L1808-1816): ff.0 is GLU(proj), ff.2 still writes. 6 adds; stack
#   attn_layers.layers, 3 blocks, sandwich.
def build_xt_sandwich_rms() -> _Built:
    from x_transformers import Decoder

    layers = Decoder(
        dim=32, depth=3, heads=2, attn_dim_head=16, sandwich_norm=True, use_rmsnorm=True,
        ff_glu=True,
    )  # fmt: skip
    model = _xt_wrapper(layers)
    s = "attn_layers.layers"
    exp = Expected(
        norms={"rmsnorm": 13},
        roles={"pre": 6, "sandwich-post": 6, "final": 1},
        stacks={s: (3, "sandwich")},
        adds_per_stack={s: 6},
        residual_adds=6,
        attention=3,
        head="to_logits",
        writers={f"{s}.{k}.2#0": _xt_writers(k, "af"[k % 2]) for k in range(6)},
    )
    return model, (_ids(),), {}, exp


# x-transformers Encoder(dim 32, depth 2, pre_norm=False, scale_residual=True):
# - L3287 `post_main_norm = norm_fn() if not pre_norm` after each add (L3729) -> post (4);
#   L3120 `keep_final_norm` is False -> final_norm is an Identity. 4 layernorm.
# - Residual L1191 `residual_scale = nn.Parameter(torch.ones(dim))`, L1199-1200 `residual =
#   residual * self.residual_scale`: a learned gain on the skip path (class 5); 4 adds.
# - Stack: attn_layers.layers, 2 blocks, post-ln. Encoder: not causal (no masked_fill).
def build_xt_postnorm_scale() -> _Built:
    from x_transformers import Encoder

    layers = Encoder(
        dim=32, depth=2, heads=2, attn_dim_head=16, pre_norm=False, scale_residual=True
    )
    model = _xt_wrapper(layers)
    s = "attn_layers.layers"
    exp = Expected(
        norms={"layernorm": 4},
        roles={"post": 4},
        stacks={s: (2, "post-ln")},
        adds_per_stack={s: 4},
        residual_adds=4,
        attention=2,
        head="to_logits",
        writers={f"{s}.{k}.2#0": _xt_writers(k, "af"[k % 2]) for k in range(4)},
    )
    return model, (_ids(),), {}, exp


# x-transformers Decoder(..., use_layerscale=True, attn_qk_norm=True):
# - L3046-3047 `LayerScale(layer, dim, init_value=0.)` with `unit_offset=True` (L3055): L1669
#   `gamma = 0 - 1`, L1676 `out * (gamma + 1)` = 0: every branch writes zeros at init (class
#   4). The writers sit under LayerScale's `fn`. attn_qk_norm: Attention L2422-2424 l2-normalizes
#   q and k functionally (no module). Norms as the default decoder: 4 pre + final.
def build_xt_layerscale_qknorm() -> _Built:
    from x_transformers import Decoder

    layers = Decoder(
        dim=32, depth=2, heads=2, attn_dim_head=16, use_layerscale=True, attn_qk_norm=True
    )
    model = _xt_wrapper(layers)
    s = "attn_layers.layers"
    exp = Expected(
        norms={"layernorm": 5},
        roles={"pre": 4, "final": 1},
        stacks={s: (2, "pre-ln")},
        adds_per_stack={s: 4},
        residual_adds=4,
        attention=2,
        head="to_logits",
        writers={
            f"{s}.0.2#0": (f"{s}.0.1.fn.to_out",),
            f"{s}.1.2#0": (f"{s}.1.1.fn.ff.2",),
        },
    )
    return model, (_ids(),), {}, exp


# x-transformers Encoder(dim 32, depth 2, macaron=True, residual_attn=True):
# - L3017-3018 macaron: blocks (f, a, f) -> layers 0..5; L3228 `Scale(0.5, FeedForward)` halves
#   the feed-forward branches (writers under `fn`). 6 pre-branch norms + final -> 7 layernorm.
# - residual_attn: L3723-3724 `prev_attn = inter.pre_softmax_attn`, Attend L558-559 `sim = sim +
#   prev_attn`: the previous layer's attention logits are added to this layer's logits before
#   the softmax; that add is not a residual add of the stream.
# - 6 adds; stack attn_layers.layers, 2 blocks of (f, a, f), pre-ln.
def build_xt_macaron_resattn() -> _Built:
    from x_transformers import Encoder

    layers = Encoder(dim=32, depth=2, heads=2, attn_dim_head=16, macaron=True, residual_attn=True)
    model = _xt_wrapper(layers)
    s = "attn_layers.layers"
    exp = Expected(
        norms={"layernorm": 7},
        roles={"pre": 6, "final": 1},
        stacks={s: (2, "pre-ln")},
        adds_per_stack={s: 6},
        residual_adds=6,
        attention=2,
        head="to_logits",
        writers={
            f"{s}.0.2#0": (f"{s}.0.1.fn.ff.2",),
            f"{s}.1.2#0": (f"{s}.1.1.to_out",),
            f"{s}.2.2#0": (f"{s}.2.1.fn.ff.2",),
        },
    )
    return model, (_ids(),), {}, exp


# x-transformers Decoder(dim 32, depth 2, attn_pre_talking_heads=True,
# attn_post_talking_heads=True): Attend (attend.py) L273-274 two `nn.Conv2d(heads, heads, 1)`
# (dirac init, L277-281); L566-567 `sim = sim + self.pre_softmax_talking_heads(sim)` mixes the
# heads' logits before the softmax, L650 `attn = self.post_softmax_talking_heads(attn)` after
# it. The logits add is inside attention, not a residual add of the stream. Otherwise as the
# default decoder: 5 layernorm (4 pre, final), 4 adds, stack of 2, 2 attention modules.
def build_xt_talking_heads() -> _Built:
    from x_transformers import Decoder

    layers = Decoder(
        dim=32, depth=2, heads=2, attn_dim_head=16, attn_pre_talking_heads=True,
        attn_post_talking_heads=True,
    )  # fmt: skip
    model = _xt_wrapper(layers)
    s = "attn_layers.layers"
    exp = Expected(
        norms={"layernorm": 5},
        roles={"pre": 4, "final": 1},
        stacks={s: (2, "pre-ln")},
        adds_per_stack={s: 4},
        residual_adds=4,
        attention=2,
        head="to_logits",
        writers={f"{s}.{k}.2#0": _xt_writers(k, "af"[k % 2]) for k in range(4)},
    )
    return model, (_ids(),), {}, exp


# x-transformers Decoder(dim 32, depth 2, attn_softclamp_logits=True): Attend L572-573 `sim =
# softclamp(sim, 30)` (L67-68, `(t / value).tanh() * value`, Gemma 2's soft-capping) between
# q.k^T (L552) and the softmax (L621). Otherwise as the default decoder.
def build_xt_softclamp() -> _Built:
    from x_transformers import Decoder

    layers = Decoder(
        dim=32, depth=2, heads=2, attn_dim_head=16, attn_softclamp_logits=True,
        attn_logit_softclamp_value=30.0,
    )  # fmt: skip
    model = _xt_wrapper(layers)
    s = "attn_layers.layers"
    exp = Expected(
        norms={"layernorm": 5},
        roles={"pre": 4, "final": 1},
        stacks={s: (2, "pre-ln")},
        adds_per_stack={s: 4},
        residual_adds=4,
        attention=2,
        head="to_logits",
        writers={f"{s}.{k}.2#0": _xt_writers(k, "af"[k % 2]) for k in range(4)},
    )
    return model, (_ids(),), {}, exp


# --------------------------------------------------------------------------------------------
# pytorchcv: CIFAR residual networks
# --------------------------------------------------------------------------------------------
#
# The CIFAR models (pytorchcv/models/*_cifar.py L52-72) share one layout: `features` = Sequential(
# init_block, stage1..stage3 (Sequential of units), [post_activ], final_pool); `output` Linear;
# the first unit of stages 2 and 3 has stride 2. Each stage is a stack of 2 units; the stages
# side by side with the stem are not listed (their first units differ).
_STAGES = ("features.stage1", "features.stage2", "features.stage3")


def _cifar_writers(tail: str) -> dict[str, tuple[str, ...]]:
    return {f"{s}.unit{u}#0": (f"{s}.unit{u}.{tail}",) for s in _STAGES for u in (1, 2)}


# pytorchcv CIFARPyramidNet (pyramidnet_cifar.py), channels [[18, 20], [22, 24], [26, 28]], basic
# blocks: PyrUnit (pyramidnet.py L102-137): `x = self.bn(self.body(x))`; L133-135 `identity =
# identity_pool(identity)` (stride 2) and `F.pad(identity, (0, 0, 0, 0, 0, out - in))`: every
# unit widens, so every skip is zero-padded in channels (class 8); L136 `x + identity` -> 6
# adds, no projection. PyrBlock L33-40: conv1 = pre_conv3x3_block(activation=None) (bn, conv),
# conv2 = pre_conv3x3_block (bn, relu, conv) (common/conv.py L721-732).
# - Norms (BatchNorm2d): body.conv1.bn reads the stream -> pre (6); body.conv2.bn -> branch (6);
#   unit `bn` after the last conv, before the add -> sandwich-post (6); init_block.bn -> other;
#   post_activ.bn (L47-48 of pyramidnet_cifar) after stage3 -> final. Total 20.
# - Writers: body.conv2.conv. Stacks: the 3 stages (2 units each), sandwich. No attention.
def build_pyramidnet_cifar() -> _Built:
    from pytorchcv.models.pyramidnet_cifar import CIFARPyramidNet

    model = CIFARPyramidNet(
        channels=[[18, 20], [22, 24], [26, 28]], init_block_channels=16, bottleneck=False
    )
    exp = Expected(
        norms={"batchnorm": 20},
        roles={"pre": 6, "branch": 6, "sandwich-post": 6, "other": 1, "final": 1},
        stacks={s: (2, "sandwich") for s in _STAGES},
        adds_per_stack=dict.fromkeys(_STAGES, 2),
        residual_adds=6,
        attention=0,
        head="output",
        writers=_cifar_writers("body.conv2.conv"),
    )
    return model, (_image(batch=2),), {}, exp


# pytorchcv CIFARPreResNet (preresnet_cifar.py), channels [[16, 16], [32, 32], [64, 64]]:
# PreResUnit (preresnet.py L127-133): `x, x_pre_activ = self.body(x)`; the projection shortcut
# L131 `identity_conv(x_pre_activ)` reads the branch's first BN+ReLU, not the stream; L132
# `x + identity` -> 6 adds, 2 projection (stage2.unit1, stage3.unit1). PreResBlock L38-41.
# - Norms (BatchNorm2d): body.conv1.bn -> pre (6); body.conv2.bn -> branch (6); post_activ.bn
#   (preresnet_cifar.py L68) -> final. The stem is a bare conv3x3 (L52). Total 13.
# - Writers: body.conv2.conv. Stacks: the 3 stages, pre-ln. Head `output`.
def build_preresnet_cifar() -> _Built:
    from pytorchcv.models.preresnet_cifar import CIFARPreResNet

    model = CIFARPreResNet(
        channels=[[16, 16], [32, 32], [64, 64]], init_block_channels=16, bottleneck=False
    )
    exp = Expected(
        norms={"batchnorm": 13},
        roles={"pre": 6, "branch": 6, "final": 1},
        stacks={s: (2, "pre-ln") for s in _STAGES},
        adds_per_stack=dict.fromkeys(_STAGES, 2),
        residual_adds=6,
        projection_adds=2,
        attention=0,
        head="output",
        writers=_cifar_writers("body.conv2.conv"),
    )
    return model, (_image(batch=2),), {}, exp


# pytorchcv CIFARResNet (resnet_cifar.py), channels [[16, 16], [32, 32], [64, 64]] (a ResNet-14
# with projection shortcuts): ResUnit (resnet.py L221-229) `identity = identity_conv(x)` (conv1x1
# + bn, stride 2 units) or `x`; `x = x + identity`; ReLU after. ResBlock L49-66: conv1 (conv, bn,
# relu), conv2 (conv, bn).
# - Norms (BatchNorm2d): body.conv{1,2}.bn in the branch -> branch (12); init_block.bn and the 2
#   identity_conv.bn -> other (3). Total 15. Writers: body.conv2.conv. Stacks: 3 stages,
#   in-branch. 6 adds, 2 projection.
def build_resnet_cifar() -> _Built:
    from pytorchcv.models.resnet_cifar import CIFARResNet

    model = CIFARResNet(
        channels=[[16, 16], [32, 32], [64, 64]], init_block_channels=16, bottleneck=False
    )
    exp = Expected(
        norms={"batchnorm": 15},
        roles={"branch": 12, "other": 3},
        stacks={s: (2, "in-branch") for s in _STAGES},
        adds_per_stack=dict.fromkeys(_STAGES, 2),
        residual_adds=6,
        projection_adds=2,
        attention=0,
        head="output",
        writers=_cifar_writers("body.conv2.conv"),
    )
    return model, (_image(batch=2),), {}, exp


# pytorchcv CIFARSEResNet (seresnet_cifar.py), same channels: SEResUnit (seresnet.py L63-72)
# `x = self.body(x); x = self.se(x); x = x + identity`: the squeeze-excitation (common/att.py
# L95-104, `x * sigmoid(conv2(relu(conv1(pool(x)))))`) gates the branch after its last conv; its
# convs are not writers; se.conv2's output multiplies the branch: the gate. Norms, stacks and
# adds as CIFARResNet.
def build_seresnet_cifar() -> _Built:
    from pytorchcv.models.seresnet_cifar import CIFARSEResNet

    model = CIFARSEResNet(
        channels=[[16, 16], [32, 32], [64, 64]], init_block_channels=16, bottleneck=False
    )
    writers = _cifar_writers("body.conv2.conv")
    exp = Expected(
        norms={"batchnorm": 15},
        roles={"branch": 12, "other": 3},
        stacks={s: (2, "in-branch") for s in _STAGES},
        adds_per_stack=dict.fromkeys(_STAGES, 2),
        residual_adds=6,
        projection_adds=2,
        attention=0,
        head="output",
        writers=writers,
        gates={k: (v[0].replace("body.conv2.conv", "se.conv2"),) for k, v in writers.items()},
    )
    return model, (_image(batch=2),), {}, exp


# pytorchcv CIFARShakeShakeResNet (shakeshakeresnet_cifar.py), same channels: ShakeShakeResUnit
# (L118-132) runs two ResBlocks on the unit's input, `x1 = branch1(x)`, `x2 = branch2(x)`, and in
# eval L129 `x = 0.5 * (x1 + x2)` (training: L126-127 a random convex mix through the autograd
# Function ShakeShake, L11-20), then L130 `x + identity`: one add with two writers, a parallel
# block. The stride-2 units' shortcut ShakeShakeShortcut (L66-75: two 1x1 convs on shifted,
# pooled inputs, concatenated, BatchNorm) makes a projection add.
# - Norms (BatchNorm2d): 2 per branch, 2 branches, 6 units -> branch (24); init_block.bn and the
#   two shortcut bns -> other (3). Total 27. Writers: branch1.conv2.conv, branch2.conv2.conv.
# - Stacks: the 3 stages, parallel; 6 adds, 2 projection.
def build_shakeshake_cifar() -> _Built:
    from pytorchcv.models.shakeshakeresnet_cifar import CIFARShakeShakeResNet

    model = CIFARShakeShakeResNet(
        channels=[[16, 16], [32, 32], [64, 64]], init_block_channels=16, bottleneck=False
    )
    writers = {
        k: (v[0].replace("body", "branch1"), v[0].replace("body", "branch2"))
        for k, v in _cifar_writers("body.conv2.conv").items()
    }
    exp = Expected(
        norms={"batchnorm": 27},
        roles={"branch": 24, "other": 3},
        stacks={s: (2, "parallel") for s in _STAGES},
        adds_per_stack=dict.fromkeys(_STAGES, 2),
        residual_adds=6,
        projection_adds=2,
        attention=0,
        head="output",
        writers=writers,
    )
    return model, (_image(batch=2),), {}, exp


# --------------------------------------------------------------------------------------------
# diffusers
# --------------------------------------------------------------------------------------------


# diffusers DiTTransformer2DModel (models/transformers/dit_transformer_2d.py), 2 layers, 2 heads
# of 16, 4x8x8 latents, patch 2, 10 classes (norm_type ada_norm_zero, L72):
# - L122-139 `transformer_blocks = ModuleList(BasicTransformerBlock)`; L184-206 run them.
#   BasicTransformerBlock (models/attention.py L752): L858 `norm1 = AdaLayerNormZero`, whose
#   forward (models/normalization.py L165-170) embeds timestep and class, computes all six
#   modulations at once `linear(silu(emb)).chunk(6)` and returns `norm(x) * (1 + scale) +
#   shift` with gate_msa, shift_mlp, scale_mlp, gate_mlp; L1013 `attn_output = gate_msa *
#   attn_output`, L1017 `attn_output + hidden_states`; L1056 `norm3(hidden_states)` modulated by
#   scale_mlp/shift_mlp (L1059), L1071 `ff_output = gate_mlp * ff_output`, L1076 `ff_output +
#   hidden_states`. gate_mlp is computed before the block's first add (class 6).
# - Norms: norm1.norm (normalization.py L149, nn.LayerNorm without affine) and norm3 (L930,
#   elementwise_affine False in DiT's config) -> pre (4); L142 `norm_out` after the blocks,
#   modulated from proj_out_1 (L209-210) -> final. Total 5 layernorm.
# - Writers: attn1.to_out.0 (diffusers Attention), ff.net.2 (FeedForward L1725-1731). The
#   adaLN linear (norm1.linear) gates both adds.
# - Stack: transformer_blocks, 2 blocks, pre-ln; 4 adds. Attention: attn1, sdpa -> 2. Head:
#   L211 `proj_out_2`.
def build_dit() -> _Built:
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=2,
        sample_size=8, patch_size=2, num_embeds_ada_norm=10,
    )  # fmt: skip
    b = "transformer_blocks"
    exp = Expected(
        norms={"layernorm": 5},
        roles={"pre": 4, "final": 1},
        stacks={b: (2, "pre-ln")},
        adds_per_stack={b: 4},
        residual_adds=4,
        attention=2,
        head="proj_out_2",
        writers={
            f"{b}.0#0": (f"{b}.0.attn1.to_out.0",),
            f"{b}.0#1": (f"{b}.0.ff.net.2",),
            f"{b}.1#1": (f"{b}.1.ff.net.2",),
        },
        gates={f"{b}.{i}#{j}": (f"{b}.{i}.norm1.linear",) for i in range(2) for j in range(2)},
    )
    latents = torch.randn(1, 4, 8, 8)
    kwargs = {
        "timestep": torch.tensor([5]),
        "class_labels": torch.tensor([3]),
        "return_dict": False,
    }
    return model, (latents,), kwargs, exp


# --------------------------------------------------------------------------------------------
# open_clip: the two towers of CLIP
# --------------------------------------------------------------------------------------------
#
# ResidualAttentionBlock (open_clip/transformer.py L238-300): L252 `ln_1`, L253 `attn =
# nn.MultiheadAttention`, L254 `ls_1 = LayerScale` (L38-45, `x * gamma`) or Identity, L258
# `ln_2`, L260-264 `mlp = Sequential(c_fc, gelu, c_proj)`; L298 `x = q_x + ls_1(attention(ln_1(
# q_x)))`, L299 `x = x + ls_2(mlp(ln_2(x)))`. Transformer L490 `resblocks = ModuleList`, L567-572
# run in a chain. The norms are open_clip's LayerNorm (L23-29, an nn.LayerNorm subclass calling
# F.layer_norm). nn.MultiheadAttention applies `out_proj.weight` itself: `attn.out_proj` writes.


def _clip_writers(prefix: str, blocks: int) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for i in range(blocks):
        out[f"{prefix}.{i}#0"] = (f"{prefix}.{i}.attn.out_proj",)
        out[f"{prefix}.{i}#1"] = (f"{prefix}.{i}.mlp.c_proj",)
    return out


# open_clip VisionTransformer, image 32, patch 8, width 32, 3 layers, 2 heads, LayerScale 1e-5:
# - Norms: L652 `ln_pre` after the class token and position add (L797), before the blocks ->
#   other; ln_1, ln_2 x 3 -> pre (6); L705 `ln_post` on the last block's tokens before pooling
#   -> final. Total 8 layernorm.
# - 6 adds (L298-299), writers attn.out_proj and mlp.c_proj, LayerScale `ls_K.gamma` scales.
# - Stack transformer.resblocks, 3, pre-ln. Attention: 3 nn.MultiheadAttention (mha). Head: L913
#   `pooled @ self.proj`, a bare parameter of the model itself -> the root, "".
def build_clip_vision() -> _Built:
    from open_clip.transformer import VisionTransformer

    model = VisionTransformer(
        image_size=32, patch_size=8, width=32, layers=3, heads=2, mlp_ratio=2.0,
        ls_init_value=1e-5, output_dim=16,
    )  # fmt: skip
    s = "transformer.resblocks"
    exp = Expected(
        norms={"layernorm": 8},
        roles={"other": 1, "pre": 6, "final": 1},
        stacks={s: (3, "pre-ln")},
        adds_per_stack={s: 6},
        residual_adds=6,
        attention=3,
        head="",
        writers=_clip_writers(s, 3),
    )
    return model, (_image(),), {}, exp


# open_clip TextTransformer, 16 tokens, vocab 128, width 32, 3 layers, 2 heads, output 16:
# - L1022 a causal additive mask buffer, passed to every block as `attn_mask` (L1224).
# - Norms: ln_1, ln_2 x 3 -> pre (6); L1017 `ln_final` (L1234) after the blocks -> final. 7.
# - 6 adds; stack transformer.resblocks, 3, pre-ln; attention 3 (mha). Pooling L935 takes the
#   argmax token; head: L1242 `pooled @ self.text_projection`, a parameter of the model (proj_bias
#   False, L1030) -> "".
def build_clip_text() -> _Built:
    from open_clip.transformer import TextTransformer

    model = TextTransformer(
        context_length=SEQ, vocab_size=VOCAB, width=32, heads=2, layers=3, mlp_ratio=2.0,
        output_dim=16,
    )  # fmt: skip
    s = "transformer.resblocks"
    exp = Expected(
        norms={"layernorm": 7},
        roles={"pre": 6, "final": 1},
        stacks={s: (3, "pre-ln")},
        adds_per_stack={s: 6},
        residual_adds=6,
        attention=3,
        head="",
        writers=_clip_writers(s, 3),
    )
    return model, (_ids(),), {}, exp


BUILDERS: dict[str, Callable[[], _Built]] = {
    "vitpt_vit": build_vit,
    "vitpt_cait": build_cait,
    "vitpt_maxvit": build_maxvit,
    "vitpt_parallel_vit": build_parallel_vit,
    "vitpt_keel_vit": build_keel_vit,
    "xt_decoder": build_xt_decoder,
    "xt_sandwich_rms": build_xt_sandwich_rms,
    "xt_postnorm_scale": build_xt_postnorm_scale,
    "xt_layerscale_qknorm": build_xt_layerscale_qknorm,
    "xt_macaron_resattn": build_xt_macaron_resattn,
    "xt_talking_heads": build_xt_talking_heads,
    "xt_softclamp": build_xt_softclamp,
    "pcv_pyramidnet_cifar": build_pyramidnet_cifar,
    "pcv_preresnet_cifar": build_preresnet_cifar,
    "pcv_resnet_cifar": build_resnet_cifar,
    "pcv_seresnet_cifar": build_seresnet_cifar,
    "pcv_shakeshake_cifar": build_shakeshake_cifar,
    "diffusers_dit": build_dit,
    "openclip_vision": build_clip_vision,
    "openclip_text": build_clip_text,
}

# (model, check) -> why it fails today (strict xfail: the day it passes, remove the entry).
# Checks: "map", "gpt2" (every writer of the discovered map), "true_gpt2" (every writer of the
# source's map, or a refusal), "convert", "probe", "diagnose" (test_real_architectures.py).
XFAIL: dict[tuple[str, str], str] = {
    ("vitpt_maxvit", "map"): (
        "issue 25 class 11: the Residual runs inside each MaxViT block (layers.0[2..7], "
        "layers.2[2..7]) and layers.1 (MBConvResidual/Residual) become stacks holding all 13 "
        "adds, `layers` holds none; the stem's two convs are a 'no-residual' stack"
    ),
}
