"""Re-initialization schemes and branch scalers, against numbers worked out by hand.

Standard deviations are checked to within 4 standard errors of a sample std: for n independent
draws the std estimate has relative standard error 1/sqrt(2n), so a layer of 4096 weights
passes within 4.4% of the target.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from hooks import hook_count
from torch import nn

import normprobe
from normprobe import tags
from normprobe.discovery import ModelMap
from normprobe.models import ResidualStack, TinyTransformer
from normprobe.reinit import (
    BranchScale,
    FixupScalars,
    branch_scales,
    cait_init,
    deepnorm_constants,
    insert_branch_scale,
    reinit,
    remove_branch_scale,
)


def assert_std(t: torch.Tensor, expected: float) -> None:
    tolerance = 4 / math.sqrt(2 * t.numel())
    got = t.detach().float().std().item()
    assert abs(got / expected - 1) < tolerance, f"std {got:.6f}, expected {expected:.6f}"


def discover(model: nn.Module, *args: Any, **kwargs: Any) -> ModelMap:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        return normprobe.discover(model, *args, **kwargs)


def read_anchors(model: nn.Module, m: ModelMap, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """The output of every residual add, read at its anchor with plain forward hooks."""
    found: dict[int, torch.Tensor] = {}
    calls: dict[int, int] = {}
    handles = []

    def pick(obj: Any, key: tuple[str | int, ...]) -> torch.Tensor:
        for k in key:
            obj = obj[k]
        assert isinstance(obj, torch.Tensor)
        return obj

    for i, add in enumerate(m.residual_adds):
        anchor = add.anchor
        assert anchor is not None
        module = model.get_submodule(anchor.module)

        def record(i: int, call: int, key: tuple[str | int, ...], where: Any) -> None:
            n = calls.get(i, 0)
            calls[i] = n + 1
            if n == call:
                found[i] = pick(where, key).detach().clone()

        if anchor.hook == "pre":
            handles.append(
                module.register_forward_pre_hook(
                    lambda _m, a, kw, i=i, an=anchor: record(i, an.call, an.key, (a, kw)),
                    with_kwargs=True,
                )
            )
        else:
            handles.append(
                module.register_forward_hook(
                    lambda _m, _a, out, i=i, an=anchor: record(i, an.call, an.key, out)
                )
            )
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return [found[i] for i in range(len(m.residual_adds))]


def without_batchnorm(model: nn.Module) -> nn.Module:
    """Every BatchNorm removed by surgery: a norm-free model for Fixup."""
    return normprobe.convert_norms(model, "identity")


def stream_rms(model: nn.Module, x: torch.Tensor, log_dir: Path) -> list[float]:
    """RMS of the residual stream after every block, in execution order, from the probe."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        probe = normprobe.attach(
            model, log_dir=str(log_dir), metrics=["resid_rms"], example_inputs=(x,)
        )
    with probe, torch.no_grad():
        model(x)
        probe.step()
    assert probe.latest is not None and probe.model_map is not None
    values = []
    for stack in probe.model_map.stacks:
        for b in range(stack.depth):
            tag = tags.format("resid_rms", stack.path, b, depth=stack.depth)
            values.append(probe.latest.scalars[tag])
    return values


# --------------------------------------------------------------------------------------------
# gpt2
# --------------------------------------------------------------------------------------------


def _gpt2(n_layer: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=zoo.VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=n_layer,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def test_gpt2_scales_the_projections_into_the_stream_as_hf_does() -> None:
    # 12 blocks: c_proj (attention and MLP) N(0, 0.02/sqrt(24)) = 0.004082, the rest N(0, 0.02)
    model = _gpt2(12)
    ids = zoo._token_ids()
    hf_std = [b.attn.c_proj.weight.std().item() for b in model.transformer.h]
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)  # whatever HF did is gone: reinit must write every tensor
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    assert reinit(model, "gpt2", example_inputs=(ids,), example_kwargs={"use_cache": False}) is (
        model
    )

    target = 0.02 / math.sqrt(2 * 12)
    assert round(target, 5) == 0.00408
    for block, hf in zip(model.transformer.h, hf_std, strict=True):
        assert_std(block.attn.c_proj.weight, target)
        assert_std(block.mlp.c_proj.weight, target)
        assert abs(hf / target - 1) < 4 / math.sqrt(2 * 64 * 64)  # HF's own init agrees
        assert_std(block.attn.c_attn.weight, 0.02)
        assert_std(block.mlp.c_fc.weight, 0.02)
        assert torch.all(block.attn.c_proj.bias == 0)
        assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)
    pooled = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    assert_std(pooled, target)
    assert_std(model.transformer.wte.weight, 0.02)
    assert_std(model.transformer.wpe.weight, 0.02)
    # same Parameter objects, tied weights still tied, the optimizer still drives the model
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    before = model.transformer.h[0].attn.c_proj.weight.detach().clone()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    assert not torch.equal(model.transformer.h[0].attn.c_proj.weight, before)


def test_gpt2_on_llama_scales_o_proj_and_down_proj() -> None:
    z = zoo.build("llama")  # 4 layers: 0.02/sqrt(8) = 0.00707
    reinit(z.model, "gpt2", example_inputs=z.args, example_kwargs=z.kwargs)
    target = 0.02 / math.sqrt(8)
    for layer in z.model.model.layers:
        assert_std(layer.self_attn.o_proj.weight, target)
        assert_std(layer.mlp.down_proj.weight, target)
        assert_std(layer.self_attn.q_proj.weight, 0.02)
        assert_std(layer.mlp.gate_proj.weight, 0.02)
        assert torch.all(layer.input_layernorm.weight == 1)
    assert_std(z.model.model.embed_tokens.weight, 0.02)


def test_gpt2_sets_gemma_gains_to_zero_because_gemma_scales_by_one_plus_weight() -> None:
    z = zoo.build("gemma2")
    with torch.no_grad():
        for n in discover(z.model).norms:
            z.model.get_submodule(n.path).weight.fill_(0.3)
    reinit(z.model, "gpt2", example_inputs=z.args, example_kwargs=z.kwargs, std=0.01)
    for layer in z.model.model.layers:
        assert torch.all(layer.input_layernorm.weight == 0)
        assert torch.all(layer.post_feedforward_layernorm.weight == 0)
        assert_std(layer.self_attn.o_proj.weight, 0.01 / math.sqrt(8))
    assert torch.all(z.model.model.norm.weight == 0)


# --------------------------------------------------------------------------------------------
# kaiming, xavier
# --------------------------------------------------------------------------------------------


def test_kaiming_keeps_the_second_moment_after_relu_and_xavier_halves_it() -> None:
    # sanity check [e]: E[x^2] = 1 into Linear(512, 512) + ReLU. Kaiming (std sqrt(2/512)) gives
    # E[y^2] = 1/2 * 512 * 2/512 = 1; Xavier gain 1 (std sqrt(2/1024)) gives 1/2.
    layer = nn.Sequential(nn.Linear(512, 512), nn.ReLU())
    x = torch.randn(4096, 512)
    reinit(layer, "kaiming")
    assert layer[0].weight.std().item() == pytest.approx(math.sqrt(2 / 512), rel=0.02)
    assert torch.all(layer[0].bias == 0)
    assert layer(x).pow(2).mean().item() == pytest.approx(1.0, rel=0.03)
    reinit(layer, "xavier")
    assert layer(x).pow(2).mean().item() == pytest.approx(0.5, rel=0.03)
    reinit(layer, "xavier", nonlinearity="relu")  # gain sqrt(2) restores it
    assert layer(x).pow(2).mean().item() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("mode", ["fan_in", "fan_out"])
def test_kaiming_reads_the_fans_of_hf_conv1d_stored_in_out(mode: str) -> None:
    z = zoo.build("gpt2")  # n_embd 64: c_fc weight is (64, 256), mlp.c_proj (256, 64)
    wte = z.model.transformer.wte.weight.detach().clone()
    reinit(z.model, "kaiming", mode=mode)
    mlp = z.model.transformer.h[0].mlp
    fc_fan, proj_fan = (64, 256) if mode == "fan_in" else (256, 64)
    assert mlp.c_fc.weight.shape == (64, 256)
    assert_std(mlp.c_fc.weight, math.sqrt(2 / fc_fan))
    assert_std(mlp.c_proj.weight, math.sqrt(2 / proj_fan))
    assert torch.equal(z.model.transformer.wte.weight, wte)  # embeddings are not kaiming'd


# --------------------------------------------------------------------------------------------
# fixup
# --------------------------------------------------------------------------------------------


def test_fixup_scales_branches_by_depth_on_resnet18() -> None:
    # L = 8 BasicBlocks, m = 2 convs each: conv1 He (fan_out = 64 * 3 * 3) times 8^-1/2,
    # conv2 0, downsample plain He (fan_out 128 * 1 * 1), classifier 0.
    z = zoo.build("resnet18")
    model = without_batchnorm(z.model)
    reinit(model, "fixup", example_inputs=z.args)
    block = model.layer1[0]
    assert isinstance(block.conv1, FixupScalars) and isinstance(block.conv2, FixupScalars)
    assert_std(block.conv1.inner.weight, math.sqrt(2 / (64 * 9)) * 8**-0.5)
    assert round(math.sqrt(2 / (64 * 9)) * 8**-0.5, 4) == 0.0208
    assert torch.all(block.conv2.inner.weight == 0)
    assert block.conv2.scale is not None and block.conv2.scale.item() == 1.0
    assert block.conv1.scale is None and block.conv1.bias_in.item() == 0.0
    assert_std(model.layer2[0].downsample[0].weight, math.sqrt(2 / 128))
    assert torch.all(model.fc.weight == 0) and torch.all(model.fc.bias == 0)


def test_fixup_uses_the_quarter_power_on_three_layer_bottlenecks() -> None:
    from timm.models.resnet import Bottleneck, ResNet

    model = without_batchnorm(
        ResNet(Bottleneck, (2, 2, 2, 2), num_classes=10, channels=(16, 32, 64, 128))
    )
    reinit(model, "fixup", example_inputs=(torch.randn(2, 3, 32, 32),))
    factor = 8 ** (-1 / (2 * 3 - 2))  # L = 8, m = 3
    assert round(factor, 4) == 0.5946
    block = model.layer3[1]  # planes 64: conv1 1x1 (fan_out 64), conv2 3x3 (fan_out 576)
    assert_std(block.conv1.inner.weight, math.sqrt(2 / 64) * factor)
    assert_std(block.conv2.inner.weight, math.sqrt(2 / (64 * 9)) * factor)
    assert torch.all(block.conv3.inner.weight == 0)


def _narrow_resnet34() -> nn.Module:
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    model = ResNet(
        BasicBlock, (3, 4, 6, 3), num_classes=10, channels=(16, 32, 64, 128), stem_width=16
    )
    return without_batchnorm(model)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 100) -> list[float]:
    # Fixup's scalar biases and multipliers at a tenth of the learning rate, as its authors
    # train them (github.com/hongyi-zhang/Fixup, cifar/cifar_train.py)
    scalars = {
        id(p)
        for m in model.modules()
        if isinstance(m, FixupScalars)
        for p in m.parameters(recurse=False)
    }
    params = list(model.parameters())
    optimizer = torch.optim.SGD(
        [
            {"params": [p for p in params if id(p) not in scalars]},
            {"params": [p for p in params if id(p) in scalars], "lr": 0.01},
        ],
        lr=0.1,
    )
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses


@pytest.mark.slow
def test_fixup_trains_a_norm_free_resnet_that_blows_up_without_it(tmp_path: Path) -> None:
    # ResNet-34's layout (16 BasicBlocks) at a quarter of its width, BatchNorm removed.
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    plain = _narrow_resnet34()
    fixed = reinit(_narrow_resnet34(), "fixup", example_inputs=(x,))

    # residual-stream RMS at init: with Fixup every branch adds exactly 0, so each identity add
    # returns its input (the stream only changes at the 4 projection shortcuts and the ReLU
    # after them); without it, the stream grows block after block.
    m = discover(fixed, x)
    assert len(m.residual_adds) == 16
    rms_fixed = stream_rms(fixed, x, tmp_path / "fixup")
    rms_plain = stream_rms(plain, x, tmp_path / "plain")
    kinds = [a.kind for a in m.residual_adds]
    for i in range(1, 16):
        if kinds[i - 1] == kinds[i] == "identity":
            assert rms_fixed[i] == pytest.approx(rms_fixed[i - 1], rel=1e-6)
    assert max(rms_fixed) <= rms_fixed[0] * (1 + 1e-6)
    assert max(rms_plain) > 5 * rms_plain[0]

    losses = _train(fixed, x, y)
    assert len(losses) == 100 and all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(10), abs=1e-5)  # zeroed classifier: uniform
    assert sum(losses[-10:]) < 0.1 * sum(losses[:10])

    blown = _train(plain, x, y)
    assert not all(math.isfinite(v) and v < 1e3 for v in blown), blown[:5]


def test_fixup_twice_resets_its_scalars_instead_of_stacking_them() -> None:
    z = zoo.build("no_norm")
    reinit(z.model, "fixup", example_inputs=z.args)
    wrapper = z.model.blocks[0].fc2
    with torch.no_grad():
        wrapper.bias_out.fill_(3.0)
    reinit(z.model, "fixup", example_inputs=z.args)
    assert z.model.blocks[0].fc2 is wrapper and wrapper.bias_out.item() == 0.0
    assert not isinstance(wrapper.inner, FixupScalars)


def test_fixup_leaves_a_tied_head_alone() -> None:
    z = zoo.build("gpt2")
    with pytest.warns(UserWarning, match="shared with"):
        reinit(z.model, "fixup", example_inputs=z.args, example_kwargs=z.kwargs, allow_norms=True)
    assert z.model.transformer.wte.weight.abs().sum() > 0


# --------------------------------------------------------------------------------------------
# deepnorm
# --------------------------------------------------------------------------------------------


def test_deepnorm_constants_and_init_on_a_12_block_post_ln_transformer() -> None:
    alpha, beta = deepnorm_constants(12)
    assert (round(alpha, 4), round(beta, 4)) == (2.2134, 0.3195)
    model = TinyTransformer(width=64, depth=12, placement="post")
    ids = torch.randint(0, 96, (2, 16))
    reinit(model, "deepnorm", example_inputs=(ids,))

    def xavier(fan_in: int, fan_out: int, gain: float) -> float:
        return gain * math.sqrt(2 / (fan_in + fan_out))

    # q|k|v is one fused Linear(64, 192): only the v third gets beta
    for block in model.blocks:
        qkv = block.attn.qkv.weight
        assert_std(qkv[:64], xavier(64, 64, 1.0))
        assert_std(qkv[64:128], xavier(64, 64, 1.0))
        assert_std(qkv[128:], xavier(64, 64, beta))
        assert_std(block.attn.proj.weight, xavier(64, 64, beta))
        assert_std(block.mlp.fc.weight, xavier(64, 256, beta))
        assert_std(block.mlp.proj.weight, xavier(256, 64, beta))
        assert torch.all(block.attn.qkv.bias == 0)
    scales = branch_scales(model)
    assert len(scales) == 24
    assert all(s.scale.item() == pytest.approx(1 / alpha) for s in scales.values())
    assert not any(s.scale.requires_grad for s in scales.values())

    # LN(x + f(x)/alpha) == LN(alpha*x + f(x)) up to LayerNorm's eps
    reference = TinyTransformer(width=64, depth=12, placement="post", alpha=alpha)
    state = {k.replace(".inner.", "."): v for k, v in model.state_dict().items()}
    reference.load_state_dict({k: v for k, v in state.items() if not k.endswith(".scale")})
    model.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=1e-4)

    reinit(model, "deepnorm", example_inputs=(ids,))  # again: same scalers, updated in place
    assert branch_scales(model).keys() == scales.keys()


def _grad_ratio(stack: ResidualStack, x: torch.Tensor) -> float:
    stack.zero_grad()
    stack(x).pow(2).mean().backward()
    norms = [
        math.sqrt(sum(p.grad.pow(2).sum().item() for p in lin.parameters())) for lin in stack.lins
    ]
    return norms[-1] / norms[0]


def test_deepnorm_moves_the_post_ln_gradient_ratio_toward_one() -> None:
    # check [d]'s 48-block Post-LN stack: last/first block gradient norm 2.35 (top-heavy)
    z = zoo.build("stack_postln")
    stack = z.model
    assert isinstance(stack, ResidualStack)
    (x,) = z.args
    before = _grad_ratio(stack, x)
    assert before == pytest.approx(2.35, abs=0.05)
    reinit(stack, "deepnorm", example_inputs=(x,))
    after = _grad_ratio(stack, x)
    assert abs(math.log(after)) < 0.25 * abs(math.log(before))


def test_deepnorm_keeps_a_skip_that_already_carries_alpha() -> None:
    z = zoo.build("deepnet")  # blocks compute LN(alpha * x + f(x)) themselves
    reinit(z.model, "deepnorm", example_inputs=z.args)
    assert branch_scales(z.model) == {}
    _, beta = deepnorm_constants(4)
    attn = z.model.blocks[0].attn
    assert_std(attn.qkv.weight[128:], beta * math.sqrt(2 / 128))


def test_deepnorm_finds_the_value_projection_of_bert_by_behaviour() -> None:
    z = zoo.build("bert")  # separate query/key/value Linears, Post-LN
    reinit(z.model, "deepnorm", example_inputs=z.args, example_kwargs=z.kwargs)
    _, beta = deepnorm_constants(4)
    layer = z.model.encoder.layer[0]
    assert_std(layer.attention.self.query.weight, math.sqrt(2 / 128))
    assert_std(layer.attention.self.key.weight, math.sqrt(2 / 128))
    assert_std(layer.attention.self.value.weight, beta * math.sqrt(2 / 128))
    assert_std(layer.intermediate.dense.weight, beta * math.sqrt(2 / (64 + 128)))
    assert len(branch_scales(z.model)) == 8


def test_deepnorm_refuses_a_pre_ln_model() -> None:
    z = zoo.build("gpt2")
    with pytest.raises(ValueError, match=r"Post-LN.*'pre-ln'"):
        reinit(z.model, "deepnorm", example_inputs=z.args, example_kwargs=z.kwargs)


# --------------------------------------------------------------------------------------------
# zero_branch and branch scalers
# --------------------------------------------------------------------------------------------


def _embedded(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])
    with torch.no_grad():
        return model.transformer.wte(ids) + model.transformer.wpe(positions)


@pytest.mark.parametrize("how", ["zero_branch", "rezero", "skipinit"])
def test_a_zeroed_branch_leaves_the_residual_stream_exactly_unchanged(how: str) -> None:
    z = zoo.build("gpt2")
    if how == "zero_branch":
        reinit(z.model, "zero_branch", example_inputs=z.args, example_kwargs=z.kwargs)
        assert all(torch.all(b.attn.c_proj.weight == 0) for b in z.model.transformer.h)
    else:
        insert_branch_scale(z.model, how, example_inputs=z.args, example_kwargs=z.kwargs)
        scales = branch_scales(z.model)
        assert len(scales) == 8 and all(s.scale.shape == () for s in scales.values())
    m = discover(z.model, *z.args, **z.kwargs)
    stream = read_anchors(z.model, m, *z.args, **z.kwargs)
    embedded = _embedded(z.model, z.args[0])
    assert len(stream) == 8 and all(torch.equal(s, embedded) for s in stream)


def test_skipinit_goes_after_the_batchnorm_that_ends_a_resnet_branch() -> None:
    z = zoo.build("resnet18")
    with torch.no_grad():
        for block in (*z.model.layer1, *z.model.layer2):
            block.bn2.bias.fill_(1.0)  # a scale before bn2 would leave this bias in the branch
    insert_branch_scale(z.model, "skipinit", example_inputs=z.args)
    assert isinstance(z.model.layer1[0].bn2, BranchScale)
    m = discover(z.model, *z.args)
    stream = read_anchors(z.model, m, *z.args)
    # layer1.1 adds nothing to the ReLU'd output of layer1.0 (all >= 0 already)
    assert torch.equal(stream[1], stream[0].relu())


@pytest.mark.slow
def test_layerscale_is_per_channel_with_cait_depth_rule() -> None:
    z = zoo.build("vit")  # 4 blocks
    insert_branch_scale(z.model, "layerscale", example_inputs=z.args)
    scales = branch_scales(z.model)
    assert len(scales) == 8
    assert all(s.scale.shape == (64,) and torch.all(s.scale == 1e-5) for s in scales.values())
    assert [cait_init(d) for d in (12, 18, 24, 36)] == [0.1, 0.1, 1e-5, 1e-6]
    deep = zoo.build("stack_preln")  # 48 blocks -> 1e-6
    insert_branch_scale(deep.model, "layerscale", init="cait", example_inputs=deep.args)
    assert all(torch.all(s.scale == 1e-6) for s in branch_scales(deep.model).values())

    conv = zoo.build("resnet18")  # BatchNorm2d output (N, C, H, W): channels on dim 1
    insert_branch_scale(conv.model, "layerscale", init=0.5, example_inputs=conv.args)
    bn2 = conv.model.layer2[1].bn2
    assert bn2.channel_dim == 1 and bn2.scale.shape == (128,)
    assert conv.model(*conv.args).shape == (2, 10)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "gemma2", "resnet18"])
def test_remove_branch_scale_folds_the_scale_and_keeps_the_function(name: str) -> None:
    z = zoo.build(name)
    keys = list(z.model.state_dict())
    with torch.no_grad():
        for m in z.model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)  # timm starts bn2 at 0, which no scale would change
        expected = z.model(*z.args, **z.kwargs)
    expected = expected if isinstance(expected, torch.Tensor) else expected.logits
    insert_branch_scale(z.model, "layerscale", example_inputs=z.args, example_kwargs=z.kwargs)
    with torch.no_grad():
        for s in branch_scales(z.model).values():
            s.scale.uniform_(0.5, 2.0)
        scaled = z.model(*z.args, **z.kwargs)
    scaled = scaled if isinstance(scaled, torch.Tensor) else scaled.logits
    assert not torch.allclose(scaled, expected)
    assert remove_branch_scale(z.model) is z.model
    assert branch_scales(z.model) == {} and list(z.model.state_dict()) == keys
    with torch.no_grad():
        folded = z.model(*z.args, **z.kwargs)
    folded = folded if isinstance(folded, torch.Tensor) else folded.logits
    torch.testing.assert_close(folded, scaled, rtol=1e-4, atol=1e-5)


def test_remove_branch_scale_without_fold_restores_the_model() -> None:
    z = zoo.build("llama")
    with torch.no_grad():
        expected = z.model(*z.args, **z.kwargs).logits
    insert_branch_scale(z.model, "rezero", example_inputs=z.args, example_kwargs=z.kwargs)
    remove_branch_scale(z.model, fold=False)
    with torch.no_grad():
        assert torch.equal(z.model(*z.args, **z.kwargs).logits, expected)
    assert hook_count(z.model) == 0


def test_a_wrapped_layer_keeps_its_parameters_and_attributes() -> None:
    z = zoo.build("gpt2")
    c_proj = z.model.transformer.h[0].attn.c_proj
    insert_branch_scale(z.model, "rezero", example_inputs=z.args, example_kwargs=z.kwargs)
    wrapper = z.model.transformer.h[0].attn.c_proj
    assert wrapper.inner is c_proj and wrapper.weight is c_proj.weight and wrapper.nf == 64
    assert "transformer.h.0.attn.c_proj.inner.weight" in z.model.state_dict()


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def test_unknown_scheme_lists_the_schemes() -> None:
    with pytest.raises(ValueError, match=r"unknown init scheme 'he'.*'gpt2'.*'zero_branch'"):
        reinit(nn.Linear(2, 2), "he")


def test_scheme_names_ignore_case_and_separators() -> None:
    z = zoo.build("no_norm")
    reinit(z.model, "Zero-Branch", example_inputs=z.args)
    assert torch.all(z.model.blocks[0].fc2.weight == 0)


@pytest.mark.parametrize(
    ("scheme", "options", "match"),
    [
        ("gpt2", {"std": 0.0}, r"std \(sigma\) must be a positive number, got 0.0"),
        ("gpt2", {"std": -0.02}, "got -0.02"),
        ("gpt2", {"n_layers": 0}, "n_layers must be a positive integer"),
        ("gpt2", {"sigma": 0.02}, r"no option 'sigma'; its options are \['n_layers', 'std'\]"),
        ("kaiming", {"mode": "fan_avg"}, r"mode must be one of \['fan_in', 'fan_out'\]"),
        ("kaiming", {"nonlinearity": "swish"}, "unknown nonlinearity 'swish'"),
        ("xavier", {"gain": -1}, "gain must be a positive number"),
        ("deepnorm", {"alpha": 0}, "alpha must be a positive number"),
    ],
)
def test_out_of_range_options_name_the_value(
    scheme: str, options: dict[str, Any], match: str
) -> None:
    z = zoo.build("stack_postln")
    with pytest.raises(ValueError, match=match):
        reinit(z.model, scheme, example_inputs=z.args, **options)


def test_branch_schemes_say_what_discovery_found() -> None:
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"found no residual adds .* Sequential .*'kaiming'"):
        reinit(mlp, "fixup", example_inputs=(torch.randn(2, 8),))
    with pytest.raises(ValueError, match="pass example_inputs"):
        reinit(mlp, "gpt2")
    with pytest.raises(ValueError, match="found no residual adds"):
        insert_branch_scale(mlp, "rezero", example_inputs=(torch.randn(2, 8),))
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module"):
        reinit("model", "gpt2")


def test_a_stale_model_map_is_refused() -> None:
    z = zoo.build("no_norm")
    m = discover(z.model, *z.args)
    insert_branch_scale(z.model, "rezero", model_map=m)
    with pytest.raises(ValueError, match="model_map does not describe this model"):
        reinit(z.model, "zero_branch", model_map=m)


def test_branch_scale_bad_input() -> None:
    z = zoo.build("no_norm")
    with pytest.raises(ValueError, match=r"unknown branch scale 'fixup'.*'rezero'"):
        insert_branch_scale(z.model, "fixup", example_inputs=z.args)
    with pytest.raises(ValueError, match="init='cait' is CaiT's LayerScale rule"):
        insert_branch_scale(z.model, "rezero", init="cait", example_inputs=z.args)
    with pytest.raises(ValueError, match="init must be a finite number or 'cait', got nan"):
        insert_branch_scale(z.model, "layerscale", init=math.nan, example_inputs=z.args)
    insert_branch_scale(z.model, "rezero", example_inputs=z.args)
    with pytest.raises(RuntimeError, match=r"already has 4 branch scalers.*remove_branch_scale"):
        insert_branch_scale(z.model, "layerscale", example_inputs=z.args)


class _OpenBranch(nn.Module):
    """``x + (fc(x) + gamma * x)``: part of the branch reaches the add without a weight layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gamma = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.fc(x) + self.gamma * x)


def test_a_branch_with_a_path_around_its_writers_is_refused_by_name() -> None:
    x = torch.randn(2, 8)
    m = normprobe.discover(_OpenBranch(), x)
    (add,) = m.residual_adds
    assert (add.writers, add.scales, add.open_path) == (("fc",), ("gamma",), True)
    for call in (
        lambda model: normprobe.insert_branch_scale(model, "rezero", example_inputs=(x,)),
        lambda model: normprobe.reinit(model, "zero_branch", example_inputs=(x,)),
    ):
        model = _OpenBranch()
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(ValueError, match=r"<root>#0 reaches the add without passing a weight"):
            call(model)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.warns(UserWarning, match=r"<root>#0 reaches the add on a path without a weight"):
        normprobe.reinit(_OpenBranch(), "gpt2", example_inputs=(x,))


def test_reinit_of_a_hugging_face_model_needs_no_inputs() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    normprobe.reinit(model, "gpt2")  # as written: the model's own dummy_inputs map it
    # 4 blocks: each block's two output projections get 0.02 / sqrt(2 * 4)
    for block in model.transformer.h:
        for layer in (block.attn.c_proj, block.mlp.c_proj):
            assert layer.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert model.transformer.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)


class _Block(nn.Module):
    def __init__(self, open_path: bool = False) -> None:
        super().__init__()
        self.open_path = open_path
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.b(torch.relu(self.a(x)))
        # tanh(x) reaches the add without a weight layer: scaling b scales only part of it
        return x + (branch - torch.tanh(x) if self.open_path else branch)


class _LastBlockOpen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block(), _Block(open_path=True)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_fixup_refusing_a_late_branch_leaves_the_earlier_ones_as_they_were() -> None:
    model = _LastBlockOpen()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"blocks\.2#0 reaches the add without"):
        normprobe.reinit(model, "fixup", example_inputs=(torch.randn(4, 8),))
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.slow
@pytest.mark.parametrize("call", ["fixup", "rezero"])
def test_wrapping_a_layer_with_a_scale_attribute_of_its_own(call: str) -> None:
    # timm's ScaledStdConv2d (NF-ResNet) keeps a float `scale`; the wrappers' own `scale`
    # parameter must not collide with it
    import timm

    torch.manual_seed(0)
    model = timm.create_model("nf_resnet26", pretrained=False, num_classes=4)
    x = torch.randn(2, 3, 32, 32)
    if call == "fixup":
        normprobe.reinit(model, "fixup", example_inputs=(x,))
        wrapped = [m for m in model.modules() if isinstance(m, FixupScalars)]
        assert all(m.scale is None or m.scale.item() == 1.0 for m in wrapped)
    else:
        normprobe.insert_branch_scale(model, "rezero", example_inputs=(x,))
        wrapped = [m for m in model.modules() if isinstance(m, BranchScale)]
        assert all(m.scale.item() == 0.0 for m in wrapped)
    convs = [m for m in wrapped if isinstance(m.inner, nn.Conv2d)]  # fixup wraps the head too
    assert convs and all(isinstance(m.inner.scale, float) for m in convs)  # the conv's own
    assert model(x).isfinite().all()
