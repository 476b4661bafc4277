"""Vision architectures for the discovery zoo: timm and torchvision models that ``zoo.py`` lacks.

Every model is built from constructor arguments (``pretrained=False`` / ``weights=None``, nothing
is downloaded), shrunk to a few blocks and channels, with random weights and a small input; it
builds in well under 2 s and runs one CPU forward in well under 1 s.

The expectations follow the rules of the discovery specification (issues 12 and 17), not what
``normprobe.discover`` printed when they were written: a residual add needs a weight layer on its
branch, ``writers`` are the last weight layer on each path from the branch's input to the add,
stacks may be held by any container (a run of same-class children in a mixed container is named
``"<container>[<first>..<last>]"``), a stage's closing norm is that stage's ``final``, and a
norm's role comes from the data flow. ``Expected`` is shared with ``zoo.py`` and its conventions
apply unchanged (see that module's docstring). A stack is only listed where it holds at least two
blocks: the rules do not say whether one child is a stack.

Line numbers refer to timm 1.0.31 and torchvision 0.29.1 under ``site-packages``. Where timm lets
the attention path be switched (``fused_attn``), the comment says which path the builder uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from zoo import Expected

__all__ = ["BUILDERS", "NAMES"]

_Built = tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]


def _image(size: int = 64) -> torch.Tensor:
    return torch.randn(1, 3, size, size)


def _set_fused_attn(model: nn.Module, fused: bool) -> None:
    """Pin timm's attention path on every module that has the switch."""
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            cast(Any, m).fused_attn = fused


# torchvision ConvNeXt (torchvision/models/convnext.py), ConvNeXt class with
# block_setting [CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)], num_classes=10, 1x3x64x64:
# - Layout (L116-153): features = Sequential(0: stem Conv2dNormActivation(Conv2d 4x4/4,
#   LayerNorm2d), 1: Sequential(2 x CNBlock), 2: Sequential(LayerNorm2d, Conv2d 2x2/2),
#   3: Sequential(2 x CNBlock)); classifier = Sequential(LayerNorm2d, Flatten, Linear) (L160).
# - Norms: LayerNorm2d (L31, an nn.LayerNorm applied after a permute) in the stem, the
#   downsample and the classifier -> 3; CNBlock L54 `norm_layer(dim)` = nn.LayerNorm(eps=1e-6)
#   (L49) inside `self.block` -> 4. Total 7 layernorm.
# - Roles: CNBlock.forward L63-67 `result = self.layer_scale * self.block(input); result +=
#   input`: the block norm sits between the depthwise conv (block.0) and block.3 -> branch (4).
#   classifier.0 normalizes the pooled features after the last stage -> final (1). The
#   downsample norm features.2.0 (L148) reads the output of features.1's last block directly and
#   sits outside that stage, in a sibling container: it follows the last block of the stack
#   features.1 -> final (1). (timm ConvNeXt's equivalent norm sits inside the NEXT stage,
#   stages.N.downsample.0, and zoo.py calls it `other`; see the report.) Stem norm -> other (1).
# - Residual adds: L66 `result += input`, once per block -> 4, identity. The branch's last
#   weight layer is block.5 (nn.Linear(4*dim, dim), L57); block.6 is a Permute. The layer scale
#   (L60, nn.Parameter of shape (dim, 1, 1)) multiplies the branch output after block.5: it is a
#   scale (`scales` = features.N.M.layer_scale), not a weight layer, so the writer is block.5.
# - Stacks: features.1 and features.3 (Sequential of 2 CNBlocks each), in-branch. (features.1,
#   features.2, features.3 are three consecutive nn.Sequential children of `features`; the rule
#   "same-class children" would make them a run `features[1..3]` although their contents
#   differ; not listed, see the report.)
# - Attention: none. Head: classifier.2.
def build_tv_convnext() -> _Built:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt  # type: ignore[import-untyped]

    model = ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)], num_classes=10)
    exp = Expected(
        norms={"layernorm": 7},
        roles={"branch": 4, "other": 1, "final": 2},
        stacks={"features.1": (2, "in-branch"), "features.3": (2, "in-branch")},
        adds_per_stack={"features.1": 2, "features.3": 2},
        residual_adds=4,
        branch_out={
            "features.1.0#0": "features.1.0.block.5",
            "features.3.0#0": "features.3.0.block.5",
            "features.3.1#0": "features.3.1.block.5",
        },
        attention=0,
        head="classifier.2",
        writers={
            "features.1.0#0": ("features.1.0.block.5",),
            "features.3.0#0": ("features.3.0.block.5",),
        },
    )
    return model, (_image(),), {}, exp


# torchvision ViT (torchvision/models/vision_transformer.py), VisionTransformer(image_size=32,
# patch_size=8, num_layers=3, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10), 1x3x32x32:
# - Norms: EncoderBlock L102 `self.ln_1`, L107 `self.ln_2` (nn.LayerNorm eps 1e-6) -> 6; Encoder
#   L152 `self.ln` -> 1. Total 7 layernorm.
# - Roles: EncoderBlock.forward L112-119: `x = self.ln_1(input); x, _ = self.self_attention(x,
#   x, x); x = x + input; y = self.ln_2(x); y = self.mlp(y); return x + y` -> ln_1/ln_2 pre (6).
#   Encoder.forward L157 `self.ln(self.layers(...))` -> final (1).
# - Residual adds: L115 `x = x + input` and L119 `x + y` -> 2 per block = 6, by
#   `encoder.layers.encoder_layer_N`, ordinals 0 and 1. L156 `input + self.pos_embedding` is a
#   position add.
# - Writers: the attention is nn.MultiheadAttention (L103); its forward passes
#   `self.out_proj.weight` to F.multi_head_attention_forward, which applies it as a linear
#   weight: the owner of that parameter, `self_attention.out_proj`, is the writer. The MLP is
#   MLPBlock(MLP) = Sequential(Linear, GELU, Dropout, Linear, Dropout) (torchvision/ops/misc.py
#   L294-303) -> mlp.3.
# - Stack: Encoder L151 `self.layers = nn.Sequential(OrderedDict(encoder_layer_i ...))` -> 3,
#   pre-ln.
# - Attention: 3 nn.MultiheadAttention -> impl mha. Head: L237 heads.head (nn.Linear).
def build_tv_vit() -> _Built:
    from torchvision.models.vision_transformer import VisionTransformer  # type: ignore[import-untyped]

    model = VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=3,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=10,
    )
    blk = "encoder.layers.encoder_layer_{}"
    exp = Expected(
        norms={"layernorm": 7},
        roles={"pre": 6, "final": 1},
        stacks={"encoder.layers": (3, "pre-ln")},
        adds_per_stack={"encoder.layers": 6},
        residual_adds=6,
        branch_out={
            f"{blk.format(0)}#0": f"{blk.format(0)}.self_attention.out_proj",
            f"{blk.format(0)}#1": f"{blk.format(0)}.mlp.3",
            f"{blk.format(2)}#1": f"{blk.format(2)}.mlp.3",
        },
        attention=3,
        head="heads.head",
        writers={
            f"{blk.format(0)}#0": (f"{blk.format(0)}.self_attention.out_proj",),
            f"{blk.format(0)}#1": (f"{blk.format(0)}.mlp.3",),
        },
    )
    return model, (_image(32),), {}, exp


# torchvision Swin (torchvision/models/swin_transformer.py), SwinTransformer(patch_size=[4, 4],
# embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4], stochastic_depth_prob=0,
# num_classes=10), 1x3x64x64 (16x16 tokens, then 8x8: both larger than the window, so the odd
# blocks shift):
# - Layout (L553-592): features = Sequential(0: Sequential(Conv2d, Permute, LayerNorm),
#   1: Sequential(2 x SwinTransformerBlock), 2: PatchMerging, 3: Sequential(2 x block)).
# - Norms (nn.LayerNorm, L551): stem features.0.2 (1); SwinTransformerBlock L433 norm1, L443
#   norm2 (2 x 4 = 8); PatchMerging L74 `self.norm` (1); L595 `self.norm` (1). Total 11.
# - Roles: SwinTransformerBlock.forward L453-454 `x = x + sd(attn(norm1(x)))`,
#   `x = x + sd(mlp(norm2(x)))` -> pre (8). L609 `x = self.norm(x)` after features -> final (1).
#   PatchMerging (features.2, a sibling of the stage features.1) L84 `x = self.norm(x)` reads
#   features.1's last block output (after padding and strided slicing) before L85's reduction
#   Linear: it follows the last block of the stack features.1 -> final (1), as torchvision
#   ConvNeXt's features.2.0. Stem norm features.0.2 -> other (1).
# - Residual adds: L453, L454 -> 2 per block = 8, by `features.{1,3}.N`, ordinals 0 and 1. Inside
#   shifted_window_attention, `attn + relative_position_bias` (L197) and the shifted-window mask
#   (L206 `masked_fill(attn_mask != 0, -100.0)`, added at L208) are attention-logit adds, not
#   residual.
# - Writers: ShiftedWindowAttention.forward (L291-313) passes `self.proj.weight` to
#   shifted_window_attention, which applies it with `F.linear(x, proj_weight, proj_bias)` (L215)
#   -> attn.proj (the parameter's owner). MLP (ops/misc.py, L444) = Sequential(Linear, GELU,
#   Dropout, Linear, Dropout) -> mlp.3.
# - Stacks: features.1, features.3 (2 blocks each), pre-ln. (features.0 and features.1 are two
#   consecutive nn.Sequential children; not listed as a run, see the report.)
# - Attention: shifted_window_attention computes `q.matmul(k.transpose)` (L189) and
#   `F.softmax` (L211); the innermost module whose forward runs both is ShiftedWindowAttention
#   (the function is called from its forward) -> 4, eager. Head: L599 `self.head`.
def build_tv_swin() -> _Built:
    from torchvision.models.swin_transformer import SwinTransformer  # type: ignore[import-untyped]

    model = SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=[4, 4],
        stochastic_depth_prob=0.0,
        num_classes=10,
    )
    exp = Expected(
        norms={"layernorm": 11},
        roles={"pre": 8, "final": 2, "other": 1},
        stacks={"features.1": (2, "pre-ln"), "features.3": (2, "pre-ln")},
        adds_per_stack={"features.1": 4, "features.3": 4},
        residual_adds=8,
        branch_out={
            "features.1.0#0": "features.1.0.attn.proj",
            "features.1.0#1": "features.1.0.mlp.3",
            "features.3.1#0": "features.3.1.attn.proj",
        },
        attention=4,
        head="head",
        writers={
            "features.1.0#0": ("features.1.0.attn.proj",),
            "features.1.0#1": ("features.1.0.mlp.3",),
            "features.3.0#0": ("features.3.0.attn.proj",),
            "features.3.0#1": ("features.3.0.mlp.3",),
        },
    )
    return model, (_image(),), {}, exp


# timm Swin (timm/models/swin_transformer.py), SwinTransformer(img_size=64, patch_size=4,
# embed_dim=16, depths=(2, 2), num_heads=(2, 4), window_size=4, drop_path_rate=0,
# num_classes=10), 1x3x64x64, with every WindowAttention's `fused_attn` set to False (L262 reads
# use_fused_attn(experimental=True); the builder pins the eager path: L361-364 `attn = q @ k^T;
# attn = attn + rel_pos_bias; attn += mask; attn = self.softmax(attn)`, where L279
# `self.softmax = nn.Softmax(dim=-1)` is a child module).
# - Norms (nn.LayerNorm): patch_embed.norm (PatchEmbed with norm_layer, L870) (1); block L432
#   norm1, L445 norm2 (8); stage 1's PatchMerging L638 `self.norm` (1); L922 `self.norm` (1).
#   Total 11 layernorm.
# - Roles: SwinTransformerBlock.forward L603, L605 -> pre (8). forward_features L1143
#   `x = self.norm(x)` after `self.layers` -> final (1). patch_embed.norm and
#   layers.1.downsample.norm (L657 norm -> reduction, at the head of stage 1, before its blocks)
#   -> other (2).
# - Residual adds: L603, L605 -> 2 per block = 8, by `layers.S.blocks.N`, ordinals 0 and 1. The
#   shifted-window mask (L508, -100 where windows differ) and the relative position bias are added
#   to attention logits, not residual.
# - Writers: WindowAttention L374 `x = self.proj(x)`; Mlp.fc2 (timm/layers/mlp.py).
# - Stacks: L920 `self.layers = nn.Sequential(SwinTransformerStage ...)` (2) and each
#   L729 `self.blocks = nn.Sequential(...)` (2), all pre-ln; adds belong to the inner stacks.
# - Attention: WindowAttention holds both `q @ k^T` and the nn.Softmax child -> 4, eager.
#   Head: ClassifierHead `head.fc` (L923).
def build_timm_swin() -> _Built:
    from timm.models.swin_transformer import SwinTransformer

    model = SwinTransformer(
        img_size=64,
        patch_size=4,
        embed_dim=16,
        depths=(2, 2),
        num_heads=(2, 4),
        window_size=4,
        drop_path_rate=0.0,
        num_classes=10,
    )
    _set_fused_attn(model, False)
    exp = Expected(
        norms={"layernorm": 11},
        roles={"pre": 8, "final": 1, "other": 2},
        stacks={
            "layers": (2, "pre-ln"),
            "layers.0.blocks": (2, "pre-ln"),
            "layers.1.blocks": (2, "pre-ln"),
        },
        adds_per_stack={"layers": 0, "layers.0.blocks": 4, "layers.1.blocks": 4},
        residual_adds=8,
        branch_out={
            "layers.0.blocks.0#0": "layers.0.blocks.0.attn.proj",
            "layers.0.blocks.0#1": "layers.0.blocks.0.mlp.fc2",
            "layers.1.blocks.1#0": "layers.1.blocks.1.attn.proj",
        },
        attention=4,
        head="head.fc",
        writers={
            "layers.0.blocks.0#0": ("layers.0.blocks.0.attn.proj",),
            "layers.0.blocks.0#1": ("layers.0.blocks.0.mlp.fc2",),
            "layers.1.blocks.0#0": ("layers.1.blocks.0.attn.proj",),
            "layers.1.blocks.0#1": ("layers.1.blocks.0.mlp.fc2",),
        },
    )
    return model, (_image(),), {}, exp


# timm RegNet (timm/models/regnet.py), RegNet(RegNetCfg(w0=16, wa=3.5, wm=1.5, group_size=8,
# depth=11, stem_width=16), num_classes=10), 1x3x64x64 (a regnetx-style config, se_ratio 0):
# - generate_regnet (L109-139) gives widths [16, 16, 24, 24, 32 x 5, 56, 56] -> 4 stages of
#   depths (2, 2, 5, 2), widths 16, 24, 32, 56, each with stride 2 (L688-697).
# - Containers: RegNet.__init__ L619 `self.add_module("s{i+1}", RegStage(...))` on the root, and
#   RegStage L526 `self.add_module("b{i+1}", Bottleneck(...))`; RegStage.forward L550-551
#   `for block in self.children(): x = block(x)`. No ModuleList/Sequential holds the blocks.
# - Norms (BatchNormAct2d, a BatchNorm2d subclass): stem ConvNormAct (L604) (1); Bottleneck
#   conv1/conv2/conv3 ConvNormAct (L324-341) -> 3 x 11 = 33; block b1 of every stage has stride 2
#   (and s2-s4 change width) -> create_shortcut (L234) -> downsample_conv = ConvNormAct(conv 1x1,
#   bn) -> 4. Total 38 batchnorm.
# - Roles: Bottleneck.forward L368-376 `shortcut = x; x = conv1(x); x = conv2(x); x = se(x);
#   x = conv3(x); x = drop_path(x) + downsample(shortcut)` -> conv1/2/3 norms are inside the
#   branch -> branch (33); stem bn and the 4 shortcut bns -> other (5).
# - Residual adds: L376, once per block -> 11, by `sK.bN` ordinal 0; the 4 b1 blocks have a
#   ConvNormAct shortcut -> projection_adds 4. Writer: conv3.conv (the Conv2d of the last
#   ConvNormAct, L341); conv3.bn follows it.
# - Stacks: s1..s4 (2, 2, 5, 2 Bottlenecks; plain nn.Module containers), in-branch. The root's
#   parameterized children are stem (ConvNormAct), s1..s4 (RegStage), head (ClassifierHead;
#   final_conv is an Identity, L639): a run of 4 chained RegStages -> "[s1..s4]" (the root's
#   path is ""), in-branch, holding no add's writer itself (0).
# - Attention: none. Head: `head.fc` (ClassifierHead, L641).
def build_timm_regnet() -> _Built:
    from timm.models.regnet import RegNet, RegNetCfg

    cfg = RegNetCfg(w0=16, wa=3.5, wm=1.5, group_size=8, depth=11, stem_width=16)
    model = RegNet(cfg, num_classes=10)
    depths = {"s1": 2, "s2": 2, "s3": 5, "s4": 2}
    stacks: dict[str, tuple[int, str]] = {s: (n, "in-branch") for s, n in depths.items()}
    stacks["[s1..s4]"] = (4, "in-branch")
    adds: dict[str, int] = dict(depths)
    adds["[s1..s4]"] = 0
    writers: dict[str, tuple[str, ...]] = {f"{s}.b1#0": (f"{s}.b1.conv3.conv",) for s in depths}
    writers["s3.b2#0"] = ("s3.b2.conv3.conv",)
    exp = Expected(
        norms={"batchnorm": 38},
        roles={"branch": 33, "other": 5},
        stacks=stacks,
        adds_per_stack=adds,
        residual_adds=11,
        branch_out={
            "s1.b1#0": "s1.b1.conv3.conv",
            "s3.b2#0": "s3.b2.conv3.conv",
            "s4.b2#0": "s4.b2.conv3.conv",
        },
        attention=0,
        head="head.fc",
        projection_adds=4,
        writers=writers,
    )
    return model, (_image(),), {}, exp


# torchvision MobileNetV2 (torchvision/models/mobilenetv2.py), MobileNetV2(num_classes=10,
# inverted_residual_setting=[[1, 8, 1, 1], [2, 16, 2, 2], [2, 24, 3, 2]]), 1x3x64x64:
# - Layout (L125-142): one flat `features` Sequential: 0 Conv2dNormActivation (stem, 32 ch),
#   1 InvertedResidual(32->8, t=1), 2 IR(8->16, s2), 3 IR(16->16), 4 IR(16->24, s2),
#   5 IR(24->24), 6 IR(24->24), 7 Conv2dNormActivation(24->1280, 1x1) (L136-140).
# - InvertedResidual (L19-64): `use_res_connect = stride == 1 and inp == oup` (L31) -> blocks 3,
#   5, 6 add; `conv` = [Conv2dNormActivation 1x1 expand (only if t != 1, L34-39),
#   Conv2dNormActivation dw (L43), Conv2d pw-linear (L52), BatchNorm2d (L53)].
# - Norms (BatchNorm2d): stem 1; block 1 (t=1) 2; blocks 2-6 3 each = 15; features.7 1.
#   Total 19.
# - Roles: forward L61-62 `return x + self.conv(x)`: the 3 BNs of blocks 3, 5, 6 are inside a
#   residual branch -> branch (9). Blocks 1, 2, 4 have no add (L64 `return self.conv(x)`), so
#   their 8 BNs are on no residual branch; the stem BN and features.7's BN (after a 1x1 conv, not
#   directly after a block) -> other (10).
# - Residual adds: L62 in blocks 3, 5, 6 -> 3, by `features.N`, ordinal 0. Writer: conv.2 (the
#   pw-linear Conv2d; conv.3 is its BN).
# - Stack: `features` mixes classes (Conv2dNormActivation, 6 InvertedResidual, Conv2dNormActivation)
#   -> the run of InvertedResiduals is "features[1..6]" (6 blocks, chained), in-branch; all 3
#   adds belong to it.
# - Attention: none. Head: L147 classifier.1 (nn.Linear).
def build_tv_mobilenet_v2() -> _Built:
    from torchvision.models.mobilenetv2 import MobileNetV2  # type: ignore[import-untyped]

    setting = [[1, 8, 1, 1], [2, 16, 2, 2], [2, 24, 3, 2]]
    model = MobileNetV2(num_classes=10, inverted_residual_setting=setting)
    exp = Expected(
        norms={"batchnorm": 19},
        roles={"branch": 9, "other": 10},
        stacks={"features[1..6]": (6, "in-branch")},
        adds_per_stack={"features[1..6]": 3},
        residual_adds=3,
        branch_out={
            "features.3#0": "features.3.conv.2",
            "features.5#0": "features.5.conv.2",
            "features.6#0": "features.6.conv.2",
        },
        attention=0,
        head="classifier.1",
        writers={
            "features.3#0": ("features.3.conv.2",),
            "features.5#0": ("features.5.conv.2",),
        },
    )
    return model, (_image(),), {}, exp


# timm CaiT (timm/models/cait.py), Cait(img_size=32, patch_size=8, embed_dim=32, depth=2,
# num_heads=2, depth_token_only=2, init_values=1e-5, num_classes=10), 1x3x32x32:
# - Norms (nn.LayerNorm eps 1e-6, L258): LayerScaleBlock L207 norm1, L217 norm2 (2 x 2 = 4);
#   LayerScaleBlockClassAttn L104 norm1, L114 norm2 (2 x 2 = 4); Cait L326 `self.norm` (1).
#   PatchEmbed has no norm. Total 9.
# - Roles: LayerScaleBlock.forward L230-231 `x = x + dp(gamma_1 * attn(norm1(x)))`, same with
#   mlp/norm2 -> pre (4). LayerScaleBlockClassAttn.forward L127-129 `u = cat((x_cls, x));
#   x_cls = x_cls + dp(gamma_1 * attn(norm1(u))); x_cls = x_cls + dp(gamma_2 * mlp(norm2(x_cls)))`:
#   norm1 reads the stream x_cls (with the patch tokens) and feeds the branch, norm2 reads x_cls
#   -> pre (4). L472 `x = self.norm(x)` after forward_cls -> final (1).
# - Residual adds: L230, L231 (2 x 2) and L128, L129 (2 x 2) -> 8, ordinals 0 and 1 by `blocks.N`
#   and `blocks_token_only.N`. `x + self.pos_embed` (L464) is a position add.
# - Writers: TalkingHeadAttn L180 `x = self.proj(x)` (proj_l/proj_w act on attention logits,
#   upstream of proj on every path); ClassAttn L76 `x_cls = self.proj(x_cls)`; Mlp.fc2. The
#   gamma_1/gamma_2 parameters (L123-124, L226-227, shape (dim,)) are scales after the writer.
# - Stacks: L296 `self.blocks = nn.Sequential(...)` (2) and L313 `self.blocks_token_only =
#   nn.ModuleList(...)` (2), both pre-ln. forward_cls L479-480 `for blk in
#   self.blocks_token_only: cls_tokens = blk(x, cls_tokens)`: the stream runs through the SECOND
#   argument; the first (the patch tokens) is the same tensor for every block.
# - Attention: ClassAttn with the default fused_attn (use_fused_attn(), L48: True) calls
#   scaled_dot_product_attention (L64) -> 2 sdpa. TalkingHeadAttn (L174) mixes the logits of
#   its heads with a Linear (proj_l) between q·k and the softmax: a documented limit of
#   normprobe, which reads logits only through elementwise ops, so not counted. Total 2.
#   Head: L329 `self.head`.
def build_timm_cait() -> _Built:
    from timm.models.cait import Cait

    model = Cait(
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
        depth_token_only=2,
        init_values=1e-5,
        num_classes=10,
    )
    exp = Expected(
        norms={"layernorm": 9},
        roles={"pre": 8, "final": 1},
        stacks={"blocks": (2, "pre-ln"), "blocks_token_only": (2, "pre-ln")},
        adds_per_stack={"blocks": 4, "blocks_token_only": 4},
        residual_adds=8,
        branch_out={
            "blocks.0#0": "blocks.0.attn.proj",
            "blocks_token_only.0#0": "blocks_token_only.0.attn.proj",
            "blocks_token_only.1#1": "blocks_token_only.1.mlp.fc2",
        },
        attention=2,
        head="head",
        writers={
            "blocks.0#0": ("blocks.0.attn.proj",),
            "blocks.0#1": ("blocks.0.mlp.fc2",),
            "blocks_token_only.0#0": ("blocks_token_only.0.attn.proj",),
            "blocks_token_only.0#1": ("blocks_token_only.0.mlp.fc2",),
        },
    )
    return model, (_image(32),), {}, exp


# timm ConvNeXt V2 (timm/models/convnext.py), convnextv2_atto (L1341-1346: use_grn=True,
# ls_init_value=None, conv_mlp=True) with depths=(2, 2, 2, 2), dims=(8, 16, 24, 32),
# num_classes=10, 1x3x64x64:
# - Norms: LayerNorm2d (conv_mlp) in the stem (L414) 1, block `self.norm` (L186) 8, stage
#   downsample Sequential(norm, conv) for stages 1-3 (L269-270) 3, NormMlpClassifierHead norm 1
#   -> 13 layernorm. GlobalResponseNorm (timm/layers/grn.py L18) in every block's
#   GlobalResponseNormMlp (layers/mlp.py L279 `self.grn`) -> 8 more norm-like modules; its
#   forward L45-47 computes `x + addcmul(bias, weight, x * x_n)` with `x_n` the spatial L2 norm
#   over its channel mean: a normalization of kind unknown (no LayerNorm/RMSNorm statistics).
#   Total 21.
# - Roles: block norm between conv_dw and mlp (L207-209) -> branch (8); grn between fc1/act and
#   fc2 inside the mlp (mlp.py L284-288) -> branch (8); stem norm and 3 downsample norms ->
#   other (4); head norm after the last stage -> final (1).
# - Residual adds: L218 `x = self.drop_path(x) + self.shortcut(shortcut)` -> 8, by
#   `stages.S.blocks.N` ordinal 0. GRN's `x + ...` (grn.py L47) is elementwise inside a
#   norm-like module with only elementwise parameters (weight/bias zero-initialized, L41-42): NOT
#   a residual add. Writer: mlp.fc2 (1x1 Conv2d, mlp.py L280); no layer scale (gamma is None).
# - Stacks: `stages` (4 ConvNeXtStage) and `stages.S.blocks` (2 each), all in-branch; adds belong
#   to the inner stacks.
# - Attention: none. Head: head.fc.
def build_timm_convnextv2() -> _Built:
    import timm

    model = timm.create_model(
        "convnextv2_atto",
        pretrained=False,
        num_classes=10,
        depths=(2, 2, 2, 2),
        dims=(8, 16, 24, 32),
    )
    stacks: dict[str, tuple[int, str]] = {"stages": (4, "in-branch")}
    adds: dict[str, int] = {"stages": 0}
    for s in range(4):
        stacks[f"stages.{s}.blocks"] = (2, "in-branch")
        adds[f"stages.{s}.blocks"] = 2
    exp = Expected(
        norms={"layernorm": 13, "unknown": 8},
        roles={"branch": 16, "other": 4, "final": 1},
        stacks=stacks,
        adds_per_stack=adds,
        residual_adds=8,
        branch_out={
            "stages.0.blocks.0#0": "stages.0.blocks.0.mlp.fc2",
            "stages.3.blocks.1#0": "stages.3.blocks.1.mlp.fc2",
        },
        attention=0,
        head="head.fc",
        writers={f"stages.{s}.blocks.0#0": (f"stages.{s}.blocks.0.mlp.fc2",) for s in range(4)},
    )
    return model, (_image(),), {}, exp


# timm ResNetV2 pre-activation (timm/models/resnetv2.py), resnetv2_18 (L1073-1079: PreActBasic,
# BatchNormAct2d, create_conv2d) with channels=(16, 32, 64, 128), stem_chs=16, num_classes=10,
# 1x3x64x64:
# - Stem (create_resnetv2_stem, preact=True, L477-520): conv + maxpool, no norm.
# - Norms (BatchNormAct2d): PreActBasic L113 norm1, L115 norm2 -> 2 x 8 = 16; L636
#   `self.norm` (preact) -> 1. DownsampleConv with preact=True has no norm (L349). Total 17.
# - Roles: PreActBasic.forward L132-143 `x_preact = self.norm1(x); shortcut = x; if downsample:
#   shortcut = self.downsample(x_preact); x = conv1(x_preact); x = conv2(norm2(x)); return x +
#   shortcut`: norm1 reads the stream and feeds the branch (and, in the 3 projection blocks, the
#   projection shortcut too) -> pre (8), whatever the kind of shortcut. norm2 sits between conv1
#   and conv2 -> branch (8). forward_features L787-788 `x = self.stages(x); x = self.norm(x)`
#   -> final (1).
# - Residual adds: L143 -> 8, by `stages.S.blocks.N` ordinal 0; stages 1-3 block 0 have stride 2
#   and a DownsampleConv (L97-108, a 1x1 conv) -> projection_adds 3. Writer: conv2 (L116). The
#   projection conv is the skip operand, not a branch writer.
# - Stacks: L608 `self.stages = nn.Sequential()` (4 ResNetStage) and ResNetStage L428
#   `self.blocks = nn.Sequential()` (2 each), all pre-ln.
# - Attention: none. Head: ClassifierHead(use_conv=True) `head.fc` (a 1x1 Conv2d, L637).
def build_timm_resnetv2() -> _Built:
    import timm

    model = timm.create_model(
        "resnetv2_18",
        pretrained=False,
        num_classes=10,
        channels=(16, 32, 64, 128),
        stem_chs=16,
    )
    stacks: dict[str, tuple[int, str]] = {"stages": (4, "pre-ln")}
    adds: dict[str, int] = {"stages": 0}
    for s in range(4):
        stacks[f"stages.{s}.blocks"] = (2, "pre-ln")
        adds[f"stages.{s}.blocks"] = 2
    exp = Expected(
        norms={"batchnorm": 17},
        roles={"pre": 8, "branch": 8, "final": 1},
        stacks=stacks,
        adds_per_stack=adds,
        residual_adds=8,
        branch_out={
            "stages.0.blocks.0#0": "stages.0.blocks.0.conv2",
            "stages.1.blocks.0#0": "stages.1.blocks.0.conv2",
            "stages.3.blocks.1#0": "stages.3.blocks.1.conv2",
        },
        attention=0,
        head="head.fc",
        projection_adds=3,
        writers={f"stages.{s}.blocks.0#0": (f"stages.{s}.blocks.0.conv2",) for s in range(4)},
    )
    return model, (_image(),), {}, exp


# timm PVT v2 (timm/models/pvt_v2.py), PyramidVisionTransformerV2(depths=(2, 2),
# embed_dims=(16, 32), num_heads=(1, 2), sr_ratios=(2, 1), mlp_ratios=(2, 2), num_classes=10),
# 1x3x64x64; default fused_attn (use_fused_attn(), L98: True) -> sdpa path (L142-143):
# - Norms: patch_embed OverlapPatchEmbed L228 `self.norm` (1); stage 1's downsample
#   OverlapPatchEmbed norm (1); Block L177 norm1, L190 norm2 (2 x 4 = 8); stage 0's Attention
#   with sr_ratio 2: L109-110 `self.sr = Conv2d(...)`, `self.norm = nn.LayerNorm` (2);
#   PyramidVisionTransformerStage L286 `self.norm` (2). Total 14 layernorm.
# - Roles: Block.forward L202-203 `x = x + dp(attn(norm1(x), ...))`, `x = x + dp(mlp(norm2(x),
#   ...))` -> pre (8). Stage forward L299-301 `for blk in self.blocks: x = blk(x, feat_size);
#   x = self.norm(x)`: each stage closes with a norm after the last block of its nested stack
#   (the inner adds have no post norm) -> that stage's final (2). Attention L134-136
#   `x = self.sr(x); x = self.norm(x); kv = self.kv(x)`: a norm inside the branch in front of the
#   key/value projection, not on projected queries/keys -> branch (2). The patch-embed norms
#   (stem, and stage 1's conv -> norm in front of its blocks) -> other (2).
# - Residual adds: L202, L203 -> 8, by `stages.S.blocks.N`, ordinals 0 and 1. Writers:
#   Attention L152 `x = self.proj(x)`; MlpWithDepthwiseConv L70 `x = self.fc2(x)`.
# - Stacks: L373 `self.stages = nn.Sequential(...)` (2) and L272 `self.blocks = nn.ModuleList`
#   (2 each; blocks take (x, feat_size), the stream is the first argument), all pre-ln.
# - Attention: 4 sdpa. Head: L378 `self.head`.
def build_timm_pvt_v2() -> _Built:
    from timm.models.pvt_v2 import PyramidVisionTransformerV2

    model = PyramidVisionTransformerV2(
        depths=(2, 2),
        embed_dims=(16, 32),
        num_heads=(1, 2),
        sr_ratios=(2, 1),
        mlp_ratios=(2.0, 2.0),
        num_classes=10,
    )
    exp = Expected(
        norms={"layernorm": 14},
        roles={"pre": 8, "final": 2, "branch": 2, "other": 2},
        stacks={
            "stages": (2, "pre-ln"),
            "stages.0.blocks": (2, "pre-ln"),
            "stages.1.blocks": (2, "pre-ln"),
        },
        adds_per_stack={"stages": 0, "stages.0.blocks": 4, "stages.1.blocks": 4},
        residual_adds=8,
        branch_out={
            "stages.0.blocks.0#0": "stages.0.blocks.0.attn.proj",
            "stages.0.blocks.0#1": "stages.0.blocks.0.mlp.fc2",
            "stages.1.blocks.1#1": "stages.1.blocks.1.mlp.fc2",
        },
        attention=4,
        head="head",
        writers={
            "stages.0.blocks.0#0": ("stages.0.blocks.0.attn.proj",),
            "stages.0.blocks.0#1": ("stages.0.blocks.0.mlp.fc2",),
            "stages.1.blocks.0#0": ("stages.1.blocks.0.attn.proj",),
            "stages.1.blocks.0#1": ("stages.1.blocks.0.mlp.fc2",),
        },
    )
    return model, (_image(),), {}, exp


# timm DeiT III (timm/models/deit.py), deit3_small_patch16_224 (L341-347: no_embed_class=True,
# init_values=1e-6) with img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2,
# num_classes=10, 1x3x32x32; every Attention's fused_attn set to False -> the eager path
# (timm/layers/attention.py L133-137: `attn = q @ k^T; attn = attn.softmax(-1)`):
# - Norms (timm LayerNorm): Block L213 norm1, L231 norm2 (6); L918 `self.norm` (1). Total 7.
# - Roles: Block.forward L250-251 -> pre (6); forward_features L1220 `x = self.norm(x)` after the
#   blocks -> final (1).
# - Residual adds: L250, L251 -> 6, by `blocks.N`, ordinals 0 and 1. Writers: attention.py L143
#   `x = self.proj(x)` and Mlp.fc2; LayerScale ls1/ls2 (L228/L241, timm/layers/layer_scale.py
#   `x * self.gamma`, gamma of shape (dim,)) follow them: scales, not writers.
# - Stack: L894 `self.blocks = nn.Sequential(...)` (3), pre-ln.
# - Attention: 3 eager. Head: L943 `self.head`.
def build_timm_deit3() -> _Built:
    import timm

    model = timm.create_model(
        "deit3_small_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=3,
        num_heads=2,
        num_classes=10,
    )
    _set_fused_attn(model, False)
    exp = Expected(
        norms={"layernorm": 7},
        roles={"pre": 6, "final": 1},
        stacks={"blocks": (3, "pre-ln")},
        adds_per_stack={"blocks": 6},
        residual_adds=6,
        branch_out={
            "blocks.0#0": "blocks.0.attn.proj",
            "blocks.0#1": "blocks.0.mlp.fc2",
            "blocks.2#1": "blocks.2.mlp.fc2",
        },
        attention=3,
        head="head",
        writers={"blocks.0#0": ("blocks.0.attn.proj",), "blocks.0#1": ("blocks.0.mlp.fc2",)},
    )
    return model, (_image(32),), {}, exp


# timm CoAtNet (timm/models/maxxvit.py), MaxxVit(MaxxVitCfg(embed_dim=(16, 24, 32, 48),
# depths=(2, 2, 2, 2), block_type=("C", "C", "T", "T"), stem_width=8,
# transformer_cfg=MaxxVitTransformerCfg(dim_head=8)), img_size=64, num_classes=10), 1x3x64x64;
# default fused_attn (Attention2d L201 use_fused_attn(): True) -> sdpa (L228), the relative
# position bias passed as attn_mask:
# - Stem (L1367-1414): conv1, norm1 (BatchNormAct2d), conv2.
# - MbConvBlock (L546-655, stages 0-1): pre_norm, norm1, norm2 (BatchNormAct2d, L598-619);
#   forward L634-655 `shortcut = self.shortcut(x); x = pre_norm(x); ... conv1_1x1, norm1,
#   conv2_kxk, norm2, se, conv3_1x1; x = drop_path(x) + shortcut`.
# - TransformerBlock2d (L415-509, stages 2-3): norm1 (for stride 2 a Sequential(norm, down),
#   L447-450), norm2 (L466) LayerNorm2d; forward L506-509 `x = shortcut(x) + ls1(attn(norm1(x)))`,
#   `x = x + ls2(mlp(norm2(x)))`.
# - Norms: batchnorm = stem 1 + 3 x 4 MbConv = 13; layernorm (LayerNorm2d) = 2 x 4 transformer
#   + final L1547 `self.norm` = 9.
# - Roles: MbConv pre_norm reads the block input and feeds only the branch -> pre (4); norm1/norm2
#   between convs -> branch (8). Transformer norm1 (`norm1` or `norm1.norm`) and norm2 -> pre
#   (8). forward_features L1711-1714 `stem; stages; self.norm` -> final (1). Stem norm -> other.
# - Residual adds: MbConv L655 (4), TransformerBlock2d L507, L508 (4 x 2 = 8) -> 12. Every
#   stage's block 0 has stride 2 and a width change -> shortcut Downsample2d(pool, 1x1 Conv2d
#   `expand`, L340-389) -> projection_adds 4. Writers: MbConv conv3_1x1 (L620; the SE module before
#   it multiplies by a sigmoid gate, upstream of the writer); Attention2d L245 `self.proj`
#   (1x1 Conv2d); ConvMlp fc2 (timm/layers/mlp.py L240). No layer scale (init_values None).
# - Stacks: L1531 `self.stages = nn.Sequential(...)` (4 MaxxVitStage) and MaxxVitStage L1322
#   `self.blocks = nn.Sequential(...)` (2 each), all pre-ln.
# - Attention: 4 Attention2d (sdpa). Head: ClassifierHead `head.fc`.
def build_timm_coatnet() -> _Built:
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitTransformerCfg

    cfg = MaxxVitCfg(
        embed_dim=(16, 24, 32, 48),
        depths=(2, 2, 2, 2),
        block_type=("C", "C", "T", "T"),
        stem_width=8,
        transformer_cfg=MaxxVitTransformerCfg(dim_head=8),
    )
    model = MaxxVit(cfg, img_size=64, num_classes=10)
    stacks: dict[str, tuple[int, str]] = {"stages": (4, "pre-ln")}
    adds: dict[str, int] = {"stages": 0}
    for s in range(4):
        stacks[f"stages.{s}.blocks"] = (2, "pre-ln")
        adds[f"stages.{s}.blocks"] = 2 if s < 2 else 4
    exp = Expected(
        norms={"batchnorm": 13, "layernorm": 9},
        roles={"pre": 12, "branch": 8, "final": 1, "other": 1},
        stacks=stacks,
        adds_per_stack=adds,
        residual_adds=12,
        branch_out={
            "stages.0.blocks.0#0": "stages.0.blocks.0.conv3_1x1",
            "stages.2.blocks.0#0": "stages.2.blocks.0.attn.proj",
            "stages.3.blocks.1#1": "stages.3.blocks.1.mlp.fc2",
        },
        attention=4,
        head="head.fc",
        projection_adds=4,
        writers={
            "stages.0.blocks.0#0": ("stages.0.blocks.0.conv3_1x1",),
            "stages.1.blocks.0#0": ("stages.1.blocks.0.conv3_1x1",),
            "stages.2.blocks.0#0": ("stages.2.blocks.0.attn.proj",),
            "stages.2.blocks.0#1": ("stages.2.blocks.0.mlp.fc2",),
            "stages.3.blocks.0#0": ("stages.3.blocks.0.attn.proj",),
            "stages.3.blocks.0#1": ("stages.3.blocks.0.mlp.fc2",),
        },
    )
    return model, (_image(),), {}, exp


# timm EfficientNet-B0 (timm/models/efficientnet.py), efficientnet_b0 (L2107-2112, arch_def
# L777-784), num_classes=10, 1x3x64x64:
# - Layout: conv_stem + bn1 (L152-153); L167 `self.blocks = nn.Sequential(*builder(...))`: 7
#   stage Sequentials with 1, 2, 2, 3, 3, 4, 1 blocks (stage 0 a DepthwiseSeparableConv, the
#   rest InvertedResidual); conv_head + bn2 (L174-175); classifier (L182).
# - Norms (BatchNormAct2d): bn1 1; DS block bn1, bn2 (2); 15 IR blocks x bn1, bn2, bn3 (45);
#   bn2 1. Total 49.
# - Residual adds: InvertedResidual `has_skip = in_chs == out_chs and stride == 1`
#   (_efficientnet_blocks.py L271) and L337-338 `x = self.drop_path(x) + shortcut`: every block
#   but the first of each stage (whose stride or width changes) -> 1+1+2+2+3 = 9 (stages 1-5),
#   by `blocks.S.N`, ordinal 0. The DS block (32->16) and stage 6 (1 block, 192->320) have no
#   skip. Writer: conv_pwl (L314; bn3 follows); the SqueezeExcite (L73-83, `x * gate(...)`)
#   gates the features before conv_pwl, upstream of the writer.
# - Roles: the 3 BNs of the 9 residual blocks -> branch (27); the BNs of the 7 blocks without a
#   skip, the stem bn1 and the head bn2 (after conv_head) -> other (22).
# - Stacks: blocks.1..blocks.5 (2, 2, 3, 3, 4 blocks), in-branch; the outer `blocks` (7 stage
#   Sequentials, chained) holds no writer itself (0). blocks.0 and blocks.6 hold one block each.
# - Attention: none. Head: classifier.
def build_timm_efficientnet() -> _Built:
    import timm

    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)
    depths = {1: 2, 2: 2, 3: 3, 4: 3, 5: 4}
    stacks: dict[str, tuple[int, str]] = {"blocks": (7, "in-branch")}
    adds: dict[str, int] = {"blocks": 0}
    for s, n in depths.items():
        stacks[f"blocks.{s}"] = (n, "in-branch")
        adds[f"blocks.{s}"] = n - 1
    exp = Expected(
        norms={"batchnorm": 49},
        roles={"branch": 27, "other": 22},
        stacks=stacks,
        adds_per_stack=adds,
        residual_adds=9,
        branch_out={
            "blocks.1.1#0": "blocks.1.1.conv_pwl",
            "blocks.5.3#0": "blocks.5.3.conv_pwl",
        },
        attention=0,
        head="classifier",
        writers={f"blocks.{s}.1#0": (f"blocks.{s}.1.conv_pwl",) for s in depths},
    )
    return model, (_image(),), {}, exp


# timm MLP-Mixer (timm/models/mlp_mixer.py), MlpMixer(img_size=32, patch_size=8, num_blocks=3,
# embed_dim=32, num_classes=10), 1x3x32x32:
# - Norms (nn.LayerNorm eps 1e-6): MixerBlock L99 norm1, L102 norm2 (6); L356 `self.norm` (1);
#   the stem PatchEmbed has no norm (stem_norm False). Total 7.
# - Roles: MixerBlock.forward L107 `x = x + dp(mlp_tokens(norm1(x).transpose(1, 2)).transpose(1,
#   2))`, L108 `x = x + dp(mlp_channels(norm2(x)))` -> pre (6); forward_features L504
#   `x = self.norm(x)` after the blocks -> final (1).
# - Residual adds: L107, L108 -> 6, by `blocks.N`, ordinals 0 and 1. Writers: mlp_tokens.fc2
#   (token mixing along the sequence, through transposes) and mlp_channels.fc2.
# - Stack: L341 `self.blocks = nn.Sequential(...)` (3), pre-ln.
# - Attention: none. Head: `self.head` (nn.Linear).
def build_timm_mlp_mixer() -> _Built:
    from timm.models.mlp_mixer import MlpMixer

    model = MlpMixer(img_size=32, patch_size=8, num_blocks=3, embed_dim=32, num_classes=10)
    exp = Expected(
        norms={"layernorm": 7},
        roles={"pre": 6, "final": 1},
        stacks={"blocks": (3, "pre-ln")},
        adds_per_stack={"blocks": 6},
        residual_adds=6,
        branch_out={
            "blocks.0#0": "blocks.0.mlp_tokens.fc2",
            "blocks.0#1": "blocks.0.mlp_channels.fc2",
            "blocks.2#0": "blocks.2.mlp_tokens.fc2",
        },
        attention=0,
        head="head",
        writers={
            "blocks.0#0": ("blocks.0.mlp_tokens.fc2",),
            "blocks.0#1": ("blocks.0.mlp_channels.fc2",),
        },
    )
    return model, (_image(32),), {}, exp


# timm PoolFormer (timm/models/metaformer.py), MetaFormer with poolformer_s12's settings
# (L1000-1012: Pooling token mixer, GroupNorm1, GELU, mlp_bias, layer scale 1e-5, no res scale,
# no downsample norm, linear head) and depths=(2, 2), dims=(16, 32), num_classes=10, 1x3x64x64:
# - Norms: MetaFormerBlock L396 norm1, L402 norm2 = GroupNorm1 (timm/layers/norm.py L53,
#   nn.GroupNorm with 1 group) -> 8 groupnorm; head.norm = output_norm LayerNorm2d (L641) -> 1
#   layernorm. Stem and Downsampling norms are Identity (downsample_norm=None). Total 9.
# - Token mixer: Pooling.forward L331-333 `y = self.pool(x); return y - x` (an AvgPool2d, no
#   parameter). MetaFormerBlock.forward L417-421 `x = res_scale1(x) + layer_scale1(dp(
#   token_mixer(norm1(x))))`: the branch holds no weight layer (GroupNorm's affine and the
#   layer-scale vector are elementwise) but a norm: a residual add with no writer (issue 25,
#   class 12; earlier versions of this zoo counted it out). L423-427 `x = res_scale2(x) +
#   layer_scale2(dp(mlp(norm2(x))))` is one too (Mlp(use_conv=True).fc2, a 1x1 Conv2d, then the
#   layer scale `layer_scale2.scale`).
# - Residual adds: 2 per block -> 8, by `stages.S.blocks.N`: ordinal 0 the pooling add (no
#   writer), ordinal 1 the MLP add (writer mlp.fc2).
# - Roles: norm1 and norm2 -> pre (8). head.norm after the pooled features of the last stage ->
#   final (1).
# - Stacks: `stages` (2 MetaFormerStage) and `stages.S.blocks` (2 each); the inner stacks'
#   adds all have a pre norm -> pre-ln.
# - Attention: none. Head: head.fc (nn.Linear).
def build_timm_poolformer() -> _Built:
    from timm.layers.norm import GroupNorm1
    from timm.models.metaformer import MetaFormer, Pooling

    model = MetaFormer(
        depths=(2, 2),
        dims=(16, 32),
        token_mixers=Pooling,
        mlp_act=nn.GELU,
        mlp_bias=True,
        norm_layers=GroupNorm1,
        layer_scale_init_values=1e-5,
        res_scale_init_values=(None, None),
        downsample_norm=None,
        use_mlp_head=False,
        num_classes=10,
    )
    exp = Expected(
        norms={"groupnorm": 8, "layernorm": 1},
        roles={"pre": 8, "final": 1},
        stacks={
            "stages": (2, "pre-ln"),
            "stages.0.blocks": (2, "pre-ln"),
            "stages.1.blocks": (2, "pre-ln"),
        },
        adds_per_stack={"stages": 0, "stages.0.blocks": 4, "stages.1.blocks": 4},
        residual_adds=8,
        branch_out={
            "stages.0.blocks.0#0": None,
            "stages.0.blocks.0#1": "stages.0.blocks.0.mlp.fc2",
            "stages.1.blocks.1#1": "stages.1.blocks.1.mlp.fc2",
        },
        attention=0,
        head="head.fc",
        writers={
            "stages.0.blocks.0#0": (),
            "stages.0.blocks.0#1": ("stages.0.blocks.0.mlp.fc2",),
            "stages.1.blocks.0#1": ("stages.1.blocks.0.mlp.fc2",),
        },
    )
    return model, (_image(),), {}, exp


BUILDERS: dict[str, Callable[[], _Built]] = {
    "tv_convnext": build_tv_convnext,
    "tv_vit": build_tv_vit,
    "tv_swin": build_tv_swin,
    "timm_swin_eager": build_timm_swin,
    "timm_regnet": build_timm_regnet,
    "tv_mobilenet_v2": build_tv_mobilenet_v2,
    "timm_cait": build_timm_cait,
    "timm_convnextv2": build_timm_convnextv2,
    "timm_resnetv2": build_timm_resnetv2,
    "timm_pvt_v2": build_timm_pvt_v2,
    "timm_deit3_eager": build_timm_deit3,
    "timm_coatnet": build_timm_coatnet,
    "timm_efficientnet_b0": build_timm_efficientnet,
    "timm_mlp_mixer": build_timm_mlp_mixer,
    "timm_poolformer": build_timm_poolformer,
}

NAMES: list[str] = list(BUILDERS)
