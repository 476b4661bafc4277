"""`reinit`'s Fixup and DeepNorm against the papers' reference formulations.

Fixup (Zhang et al. 2019): the reference ResNet-20 for CIFAR is written out here from the
paper's description (Sec. 3 and Fig. 1: a scalar bias before each convolution, linear and
activation layer, a scalar multiplier on each branch, the last layer of each branch and the
classifier at 0, the others He-normal times L^(-1/(2m-2))); a plain ResNet-20 without
normalization given ``reinit(model, "fixup")`` must compute what it computes.

DeepNorm (Wang et al. 2022, "DeepNet"): the constants by hand, on Post-LN encoder-decoders and
decoder-only stacks.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import normprobe
from normprobe import FixupScalars
from normprobe.reinit import deepnorm_constants, deepnorm_encoder_decoder_constants


def assert_std(t: torch.Tensor, expected: float) -> None:
    """Within 4 standard errors of a sample std (relative error 1/sqrt(2n) for n draws)."""
    tolerance = 4 / math.sqrt(2 * t.numel())
    got = t.detach().float().std().item()
    assert abs(got / expected - 1) < tolerance, f"std {got:.6f}, expected {expected:.6f}"


# --------------------------------------------------------------------------------------------
# Fixup: the CIFAR ResNet-20 of the paper, with projection (1x1 conv) shortcuts
# --------------------------------------------------------------------------------------------


def _conv3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride, 1, bias=False)


def _scalar(value: float) -> nn.Parameter:
    return nn.Parameter(torch.full((1,), value))


class ReferenceBlock(nn.Module):
    """Fixup's basic block: biases before conv1 (a), its ReLU (b), conv2 (a) and after the
    multiplier (b); a projection shortcut reads the input shifted as conv1 reads it."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.bias1a, self.bias1b, self.bias2a, self.bias2b = (_scalar(0.0) for _ in range(4))
        self.scale = _scalar(1.0)
        self.conv1, self.conv2 = _conv3(cin, cout, stride), _conv3(cout, cout)
        project = stride != 1 or cin != cout
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if project else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.conv1(x + self.bias1a) + self.bias1b)
        out = self.conv2(out + self.bias2a) * self.scale + self.bias2b
        skip = x if self.shortcut is None else self.shortcut(x + self.bias1a)
        return F.relu(out + skip)


class PlainBlock(nn.Module):
    """The same block with neither normalization nor Fixup's scalars."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv3(cin, cout, stride), _conv3(cout, cout)
        project = stride != 1 or cin != cout
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if project else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(F.relu(self.conv1(x)))
        skip = x if self.shortcut is None else self.shortcut(x)
        return F.relu(out + skip)


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He et al. 2016): a 3x3 stem to 16 channels, 3 stages of 3 blocks at
    16/32/64 channels (stride 2 into stages 2 and 3), global average pool, a linear classifier.
    ``fixup``: the scalar bias after the stem (before its ReLU) and before the classifier."""

    def __init__(self, block: type[nn.Module], fixup: bool) -> None:
        super().__init__()
        self.conv1 = _conv3(3, 16)
        self.bias1 = _scalar(0.0) if fixup else None
        stages = []
        for cin, cout, stride in [(16, 16, 1), (16, 32, 2), (32, 64, 2)]:
            blocks = [block(cin, cout, stride), block(cout, cout, 1), block(cout, cout, 1)]
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.bias2 = _scalar(0.0) if fixup else None
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = F.relu(x if self.bias1 is None else x + self.bias1)
        x = self.stages(x).mean((2, 3))
        return self.fc(x if self.bias2 is None else x + self.bias2)


# normprobe's name of each parameter -> the reference's (a scalar: one of the paper's biases)
_REFERENCE_NAMES = [
    (r"conv1\.bias_in$", "bias1a"),
    (r"conv1\.bias_out$", "bias1b"),
    (r"conv2\.bias_in$", "bias2a"),
    (r"conv2\.scale$", "scale"),
    (r"conv2\.bias_out$", "bias2b"),
    (r"shortcut\.bias_in$", "bias1a"),
    (r"\.inner\.", "."),
]


def _reference_name(name: str) -> str:
    if name == "conv1.bias_out":
        return "bias1"  # the stem's
    if name == "fc.bias_in":
        return "bias2"
    for pattern, replacement in _REFERENCE_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


def _fixup_resnet20() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    return normprobe.reinit(ResNet20(PlainBlock, fixup=False), "fixup", example_inputs=(x,)), x


def test_fixup_initializes_resnet20_as_the_paper_does() -> None:
    # L = 9 branches of m = 2 convs: conv1 He-normal (fan_out = cout * 3 * 3, as the authors'
    # code computes it) times 9^(-1/2) = 1/3; conv2 and the classifier 0; shortcuts plain He
    model, _ = _fixup_resnet20()
    for stage, cout in zip(model.stages, (16, 32, 64), strict=True):
        for block in stage:
            assert_std(block.conv1.inner.weight, math.sqrt(2 / (cout * 9)) / 3)
            assert not block.conv2.inner.weight.any()
            if block.shortcut is not None:
                assert_std(block.shortcut.inner.weight, math.sqrt(2 / cout))
    assert round(math.sqrt(2 / (16 * 9)) / 3, 4) == 0.0393
    assert not model.fc.inner.weight.any() and not model.fc.inner.bias.any()


def test_fixup_adds_the_papers_scalars_to_resnet20() -> None:
    model, _ = _fixup_resnet20()
    reference = ResNet20(ReferenceBlock, fixup=True)
    scalars = {n: p for n, p in model.named_parameters(remove_duplicate=False) if p.ndim == 0}
    # each block's five, the stem's bias and the classifier's: 9 * 5 + 2 = 47, as the reference
    assert len({id(p) for p in scalars.values()}) == 47
    assert sum(p.numel() == 1 for p in reference.parameters()) == 47
    assert {_reference_name(n) for n in scalars} == {
        n for n, p in reference.named_parameters() if p.numel() == 1
    }
    for stage in model.stages:
        block = stage[0]
        if block.shortcut is not None:  # fed x + bias1a: the branch's own Parameter
            assert block.shortcut.bias_in is block.conv1.bias_in
    assert [s.item() for n, s in scalars.items() if n.endswith("scale")] == [1.0] * 9
    assert all(s.item() == 0.0 for n, s in scalars.items() if "bias" in n)


@pytest.mark.slow
def test_fixup_again_resets_the_scalars_it_added() -> None:
    model, x = _fixup_resnet20()
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    block = model.stages[1][0]
    with torch.no_grad():
        for p in (block.conv1.bias_in, model.conv1.bias_out, model.fc.bias_in):
            p.fill_(2.0)
    normprobe.reinit(model, "fixup", example_inputs=(x,))
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == names
    assert block.shortcut.bias_in is block.conv1.bias_in
    assert [p.item() for p in (block.conv1.bias_in, model.conv1.bias_out, model.fc.bias_in)] == [
        0.0
    ] * 3


@pytest.mark.slow
def test_fixup_resnet20_computes_what_the_reference_computes() -> None:
    model, x = _fixup_resnet20()
    reference = ResNet20(ReferenceBlock, fixup=True)
    target = dict(reference.named_parameters())
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if not getattr(p, "_drawn", False):  # a shared bias is drawn once
                p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 0 else 0.1))
                p._drawn = True  # type: ignore[attr-defined]
            target[_reference_name(name)].copy_(p.reshape(target[_reference_name(name)].shape))
    # the copies cover every reference parameter
    assert {_reference_name(n) for n, _ in model.named_parameters(remove_duplicate=False)} == set(
        target
    )
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Fixup refuses a model that still normalizes
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fixup_refuses_a_model_with_batchnorm_and_says_how_to_remove_it() -> None:
    z = zoo.build("resnet18")
    before = {k: v.clone() for k, v in z.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"20 norm layers \(the first: batchnorm at 'bn1'\)"):
        normprobe.reinit(z.model, "fixup", example_inputs=z.args)
    after = z.model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(ValueError, match=r"normprobe\.convert_norms\(model, 'identity'\)"):
        normprobe.reinit(z.model, "fixup", example_inputs=z.args)
    with pytest.raises(ValueError, match="allow_norms must be True or False"):
        normprobe.reinit(z.model, "fixup", example_inputs=z.args, allow_norms="yes")
    # the two ways out: the norms removed, or kept on purpose
    freed = normprobe.reinit(
        normprobe.convert_norms(z.model, "identity"), "fixup", example_inputs=z.args
    )
    assert isinstance(freed.layer1[0].conv2, FixupScalars)
    kept = zoo.build("resnet18").model
    normprobe.reinit(kept, "fixup", example_inputs=z.args, allow_norms=True)
    assert isinstance(kept.layer1[0].conv2, FixupScalars) and isinstance(kept.bn1, nn.BatchNorm2d)


def test_fixup_refuses_layernorm_as_well() -> None:
    z = zoo.build("gpt2")
    with pytest.raises(ValueError, match=r"layernorm at 'transformer\.h\.0\.ln_1'"):
        normprobe.reinit(z.model, "fixup", example_inputs=z.args, example_kwargs=z.kwargs)


# --------------------------------------------------------------------------------------------
# DeepNorm: encoder-decoder constants
# --------------------------------------------------------------------------------------------

D = 64  # a 64x64 projection: 4096 draws, its std within 4.4%


class Attention(nn.Module):
    """Multi-head attention with separate q, k, v and output projections; ``memory`` makes it
    cross-attention (keys and values from the encoder)."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        source = x if memory is None else memory

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            split(self.q(x)), split(self.k(source)), split(self.v(source)), is_causal=causal
        )
        return self.o(out.transpose(1, 2).reshape(x.shape))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Post-LN: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.ln1, self.ffn, self.ln2 = (
            Attention(),
            nn.LayerNorm(D),
            FeedForward(),
            nn.LayerNorm(D),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


class DecoderBlock(nn.Module):
    """Post-LN: causal self-attention, cross-attention to the encoder's output, feed-forward."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.ln1 = Attention(), nn.LayerNorm(D)
        self.cross, self.ln2 = Attention(), nn.LayerNorm(D)
        self.ffn, self.ln3 = FeedForward(), nn.LayerNorm(D)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x, causal=True))
        x = self.ln2(x + self.cross(x, memory))
        return self.ln3(x + self.ffn(x))


class Seq2Seq(nn.Module):
    """A Post-LN Transformer encoder-decoder (Vaswani et al. 2017) of N and M blocks;
    ``decoders=2``: two decoders reading the same encoder."""

    def __init__(self, n: int, m: int, decoders: int = 1) -> None:
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(32, D), nn.Embedding(32, D)
        self.encoder = nn.ModuleList(EncoderBlock() for _ in range(n))
        self.decoder = nn.ModuleList(DecoderBlock() for _ in range(m))
        self.decoder2 = nn.ModuleList(DecoderBlock() for _ in range(m if decoders == 2 else 0))
        self.head = nn.Linear(D, 32)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.src_embed(src)
        for block in self.encoder:
            memory = block(memory)
        out = []
        for stack in (self.decoder, self.decoder2):
            x = self.tgt_embed(tgt)
            for block in stack:
                x = block(x, memory)
            out.append(self.head(x))
        return out[0] if len(self.decoder2) == 0 else out[0] + out[1]


class TwoStages(nn.Module):
    """Two Post-LN stacks one after the other on one stream (no encoder-decoder)."""

    def __init__(self, n1: int, n2: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, D)
        self.stage1 = nn.ModuleList(EncoderBlock() for _ in range(n1))
        self.stage2 = nn.ModuleList(EncoderBlock() for _ in range(n2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in [*self.stage1, *self.stage2]:
            x = block(x)
        return x


def _xavier(layer: nn.Module, gain: float) -> float:
    fan_out, fan_in = layer.weight.shape
    return gain * math.sqrt(2 / (fan_in + fan_out))


def _deepnorm(model: nn.Module, *inputs: torch.Tensor, **options: float) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        return normprobe.reinit(model, "deepnorm", example_inputs=inputs, **options)


def _alpha(block: nn.Module, branch: str) -> float:
    """The skip's alpha as realized: 1 / the fixed scale on the branch's last layer."""
    end = block.get_submodule(branch)
    assert isinstance(end, normprobe.BranchScale), branch
    return 1 / end.scale.item()


def test_deepnorm_constants_of_an_encoder_decoder_by_hand() -> None:
    # N = M = 6: N^4 M = 7776; 7776^(1/16) = 1.7505
    (a_enc, b_enc), (a_dec, b_dec) = deepnorm_encoder_decoder_constants(6, 6)
    assert round(7776 ** (1 / 16), 4) == 1.7505
    assert a_enc == pytest.approx(0.81 * 1.7505, abs=1e-4)  # 1.4179
    assert b_enc == pytest.approx(0.87 / 1.7505, abs=1e-4)  # 0.4970
    assert a_dec == pytest.approx(18**0.25) and round(a_dec, 4) == 2.0598
    assert b_dec == pytest.approx(72**-0.25) and round(b_dec, 4) == 0.3433
    # decoder-only, unchanged: (2N)^(1/4), (8N)^(-1/4)
    assert deepnorm_constants(6) == pytest.approx((12**0.25, 48**-0.25))
    with pytest.raises(ValueError, match="decoder_layers must be a positive integer"):
        deepnorm_encoder_decoder_constants(6, 0)


@pytest.mark.slow
@pytest.mark.parametrize("tgt_len", [5, 9])  # 9: the encoder's output has the stream's shape
def test_deepnorm_uses_the_encoder_decoder_formulas_on_an_encoder_decoder(tgt_len: int) -> None:
    torch.manual_seed(0)
    model = Seq2Seq(6, 6)
    src, tgt = torch.randint(0, 32, (2, 9)), torch.randint(0, 32, (2, tgt_len))
    _deepnorm(model, src, tgt)
    a_enc, b_enc = 0.81 * 7776 ** (1 / 16), 0.87 * 7776 ** (-1 / 16)  # N^4 M = 6^4 * 6
    a_dec, b_dec = 18**0.25, 72**-0.25  # (3M)^(1/4), (12M)^(-1/4)
    for block in model.encoder:
        assert _alpha(block, "attn.o") == pytest.approx(a_enc, rel=1e-6)
        assert _alpha(block, "ffn.fc2") == pytest.approx(a_enc, rel=1e-6)
    for block in model.decoder:
        for end in ("attn.o", "cross.o", "ffn.fc2"):
            assert _alpha(block, end) == pytest.approx(a_dec, rel=1e-6)
    enc, dec = model.encoder[0], model.decoder[0]
    # Xavier-normal: gain beta on values, outputs and feed-forward; 1 on queries and keys
    for layer, gain in [
        (enc.attn.q, 1.0),
        (enc.attn.k, 1.0),
        (enc.attn.v, b_enc),
        (enc.attn.o.inner, b_enc),
        (enc.ffn.fc1, b_enc),
        (dec.cross.q, 1.0),
        (dec.cross.k, 1.0),
        (dec.cross.v, b_dec),
        (dec.cross.o.inner, b_dec),
        (dec.attn.v, b_dec),
        (dec.ffn.fc1, b_dec),
    ]:
        assert_std(layer.weight, _xavier(layer, gain))


def test_deepnorm_on_torchs_post_ln_transformer() -> None:
    # nn.Transformer (norm_first=False): 3 encoder and 2 decoder layers, each attention an
    # nn.MultiheadAttention with one in_proj_weight for q|k|v
    torch.manual_seed(0)
    model = nn.Transformer(D, 4, 3, 2, 2 * D, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 9, D), torch.randn(2, 5, D)
    _deepnorm(model, src, tgt)
    a_enc, b_enc = 0.81 * 162 ** (1 / 16), 0.87 * 162 ** (-1 / 16)  # N^4 M = 3^4 * 2
    a_dec, b_dec = 6**0.25, 24**-0.25
    enc, dec = model.encoder.layers[0], model.decoder.layers[0]
    assert _alpha(enc, "linear2") == pytest.approx(a_enc, rel=1e-6)
    assert _alpha(dec, "multihead_attn.out_proj") == pytest.approx(a_dec, rel=1e-6)
    for attention, beta in [(enc.self_attn, b_enc), (dec.multihead_attn, b_dec)]:
        q, k, v = attention.in_proj_weight.chunk(3)
        std = math.sqrt(2 / (2 * D))
        assert_std(q, std)
        assert_std(k, std)
        assert_std(v, beta * std)
        assert not attention.in_proj_bias.any()


@pytest.mark.slow
def test_deepnorm_keeps_the_single_stack_formulas_on_one_stack_and_on_stages() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 9))
    model = TwoStages(4, 2)  # one stream through both: not an encoder-decoder
    _deepnorm(model, ids)
    assert _alpha(model.stage1[0], "ffn.fc2") == pytest.approx(8**0.25)  # (2N)^(1/4), N = 4
    assert_std(model.stage1[0].attn.v.weight, _xavier(model.stage1[0].attn.v, 32**-0.25))
    assert _alpha(model.stage2[0], "ffn.fc2") == pytest.approx(4**0.25)


@pytest.mark.slow
def test_deepnorm_refuses_when_it_cannot_tell_the_encoder_decoder_formulas() -> None:
    torch.manual_seed(0)
    model = Seq2Seq(2, 2, decoders=2)
    src, tgt = torch.randint(0, 32, (2, 9)), torch.randint(0, 32, (2, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"has 3 stacks.*pass n_layers=.*or alpha= and beta="):
        _deepnorm(model, src, tgt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    _deepnorm(model, src, tgt, alpha=2.0, beta=0.5)  # explicit constants: no question left
    assert _alpha(model.decoder2[0], "cross.o") == pytest.approx(2.0)


def test_deepnorm_matches_torchscale_encoder_decoder_alphas() -> None:
    # torchscale builds the skip as x * alpha + f(x): discovery reads that alpha, and
    # normprobe's own constants must equal it, so no branch scale is left to insert
    pytest.importorskip("fairscale")
    config_module = pytest.importorskip("torchscale.architecture.config")
    from torchscale.architecture.encoder_decoder import EncoderDecoder
    from torchscale.component.embedding import TextEmbedding

    torch.manual_seed(0)
    config = config_module.EncoderDecoderConfig(
        deepnorm=True,
        encoder_layers=6,
        decoder_layers=4,
        vocab_size=32,
        encoder_embed_dim=D,
        decoder_embed_dim=D,
        encoder_ffn_embed_dim=2 * D,
        decoder_ffn_embed_dim=2 * D,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
    )
    model = EncoderDecoder(
        config,
        encoder_embed_tokens=TextEmbedding(32, D),
        decoder_embed_tokens=TextEmbedding(32, D),
        output_projection=nn.Linear(D, 32, bias=False),
    )
    src, tgt = torch.randint(0, 32, (2, 9)), torch.randint(0, 32, (2, 5))
    a_enc, b_enc = 0.81 * 5184 ** (1 / 16), 0.87 * 5184 ** (-1 / 16)  # N^4 M = 6^4 * 4
    a_dec, b_dec = 12**0.25, 48**-0.25  # (3M)^(1/4), (12M)^(-1/4)
    assert model.encoder.layers[0].alpha == pytest.approx(a_enc, rel=1e-12)
    assert model.decoder.layers[0].alpha == pytest.approx(a_dec, rel=1e-12)
    # torchscale's own init: PyTorch's default for nn.Linear (std 1/sqrt(3 fan_in)), divided
    # by its init_scale; the decoder's beta is the paper's (12M)^(-1/4), the encoder's is
    # 1.15 (N^4 M)^(-1/16) where the paper has 0.87 (N^4 M)^(-1/16)
    v_enc = model.encoder.layers[0].self_attn.v_proj
    v_dec = model.decoder.layers[0].encoder_attn.v_proj
    assert_std(v_dec.weight, b_dec / math.sqrt(3 * D))
    assert_std(v_enc.weight, b_enc * (1.15 / 0.87) / math.sqrt(3 * D))
    _deepnorm(model, src, tgt)
    assert normprobe.branch_scales(model) == {}
    assert_std(v_enc.weight, _xavier(v_enc, b_enc))  # the paper's, gain 1 otherwise
    assert_std(v_dec.weight, _xavier(v_dec, b_dec))
