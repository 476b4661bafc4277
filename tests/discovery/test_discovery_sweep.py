"""Discovery on layouts a sweep over Hugging Face architectures found mapped wrong: an encoder
and a decoder of one class are no stack, and blocks LayerDrop skipped in the traced forward
keep their place in their stack."""

from __future__ import annotations

import math
import random
import warnings
from collections import Counter

import pytest
import torch
from torch import nn
from zoo_hf import wav2vec2_config

import normprobe


class Block(nn.Module):
    """``h + fc(ln(h))``, plus ``fc(memory)`` when given one (cross-attention's stand-in)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.cross = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.fc(self.ln(x))
        return h if memory is None else h + self.cross(memory)


class Tower(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, memory)
        return x


class EncoderDecoder(nn.Module):
    """Two towers of one class side by side, as T5 holds its encoder and decoder: the decoder
    reads the encoder's output only as ``memory``, its stream starts from its own input."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.encoder = Tower(width, depth)
        self.decoder = Tower(width, depth)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.decoder(target, memory=self.encoder(source))


def _stacks(model: nn.Module, *args: torch.Tensor) -> dict[str, int]:
    return {s.path: s.depth for s in normprobe.discover(model, *args).stacks}


def test_an_encoder_and_a_decoder_of_one_class_are_no_stack() -> None:
    x = torch.randn(2, 5, 8)
    stacks = _stacks(EncoderDecoder(), x, x)
    assert stacks == {"encoder.blocks": 3, "decoder.blocks": 3}


class Chained(nn.Module):
    """Towers chained on the stream (the second takes the first's output as its input): a stack
    of two, whether the stream is passed by position or by name."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.first = Tower(width, 2)
        self.second = Tower(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(x=self.first(x))


def test_towers_chained_on_the_stream_stay_a_stack() -> None:
    stacks = _stacks(Chained(), torch.randn(2, 5, 8))
    assert stacks == {"": 2, "first.blocks": 2, "second.blocks": 2}  # the root holds both


class SkipsInTraining(nn.Module):
    """A stack whose second block is skipped in training, as LayerDrop may skip any block."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if self.training and i == 1:
                continue
            x = block(x)
        return x


def test_a_block_skipped_in_training_keeps_its_place() -> None:
    model = SkipsInTraining().train()
    m = normprobe.discover(model, torch.randn(2, 5, 8))
    assert [(s.path, s.depth) for s in m.stacks] == [("blocks", 4)]
    assert len(m.adds_in("blocks")) == 4  # the skipped block's add is known too
    assert model.training and all(b.training for b in model.blocks)  # the mode is restored


@pytest.mark.slow
def test_layerdrop_in_wav2vec2_loses_no_block() -> None:
    from transformers import Wav2Vec2ForCTC

    torch.manual_seed(0)
    # half the layers skipped in a training forward, on average
    model = Wav2Vec2ForCTC(wav2vec2_config(layers=4, layerdrop=0.5)).train()
    x = torch.randn(2, 1000)
    for seed in range(3):
        torch.manual_seed(seed)
        m = normprobe.discover(model, x)
        layers = m.stack("wav2vec2.encoder.layers")
        assert layers.blocks == tuple(f"wav2vec2.encoder.layers.{i}" for i in range(4))
        assert len(m.adds_in("wav2vec2.encoder.layers")) == 8  # attention and feed-forward


def test_layer_dropout_skipping_a_container_block_loses_no_block() -> None:
    """x-transformers keeps each sublayer in a ModuleList of (norms, branch, residual) that its
    parent iterates (never calls) and skips whole entries under ``layer_dropout`` in training:
    the entries of a skipped one are not called at all."""
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    layers = Decoder(dim=16, depth=4, heads=2, layer_dropout=0.3)
    model = TransformerWrapper(num_tokens=32, max_seq_len=16, attn_layers=layers).train()
    x = torch.randint(0, 32, (2, 8))
    for seed in range(4):  # seeds 0..3 skip one to three of the eight entries
        random.seed(seed)
        m = normprobe.discover(model, x)
        assert [(s.path, s.depth) for s in m.stacks] == [("attn_layers.layers", 4)]
        assert len(m.adds_in("attn_layers.layers")) == 8
    assert model.training


def _pegasus() -> nn.Module:
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    config = PegasusConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    return PegasusForConditionalGeneration(config)


def test_dummy_inputs_the_model_does_not_run_on_fall_back_to_the_module_tree() -> None:
    # the dummy_inputs transformers gives Pegasus make its own forward raise
    model = _pegasus()
    ids = torch.randint(3, 96, (2, 6))
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model(**model.dummy_inputs)
    normprobe.convert_norms(model, "rmsnorm")
    assert {type(m) for m in model.modules() if "Norm" in type(m).__name__} == {nn.RMSNorm}
    assert model(input_ids=ids, labels=ids).loss.isfinite()
    with pytest.raises(ValueError, match="example_inputs") as refused:
        normprobe.reinit(_pegasus(), "gpt2")  # its stream writers are known from a forward only
    assert "raised while normprobe.discover" not in "".join(getattr(refused.value, "__notes__", []))


def test_a_hybrid_of_mamba_and_attention_layers_is_one_stack() -> None:
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_experts=2,
        num_experts_per_tok=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,  # Mamba, attention, Mamba, attention
        attn_layer_offset=1,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    )
    torch.manual_seed(0)
    model = JambaForCausalLM(config)
    ids = torch.randint(3, 96, (2, 12))
    m = normprobe.discover(model, input_ids=ids)
    assert [(s.path, s.depth) for s in m.stacks] == [("model.layers", 4)]
    assert m.stacks[0].block_type == "JambaAttentionDecoderLayer/JambaMambaDecoderLayer"
    assert len(m.adds_in("model.layers")) == 8  # each layer: its mixer's add and its MLP's
    sink = normprobe.MemorySink()
    with normprobe.attach(model, sinks=[sink], metrics=["resid_rms"], every=1) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
        probe.step()
    rms = sink.records[0].profiles[normprobe.tags.format("resid_rms", "model.layers")]
    assert len(rms) == 4 and all(v > 0 for v in rms)


def test_a_tensor_lending_only_its_dtype_is_no_input() -> None:
    # Funnel turns its attention mask into a score bias with mask.type_as(embeddings): the
    # embeddings' norm does not feed the scores, so it is no qk-norm (as BERT's, it is "other")
    from transformers import FunnelConfig, FunnelModel

    config = FunnelConfig(
        vocab_size=96, block_sizes=[1, 1], num_decoder_layers=1, d_model=32, n_head=4, d_head=8
    )
    torch.manual_seed(0)
    m = normprobe.discover(FunnelModel(config), input_ids=torch.randint(3, 96, (2, 12)))
    roles = {n.path: n.role for n in m.norms}
    assert roles["embeddings.layer_norm"] == "other"
    assert "qk" not in roles.values()


class GainFree(nn.Module):
    """Pre-LN blocks whose LayerNorm learns no gain, as OLMo's."""

    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.lns = nn.ModuleList(
            nn.LayerNorm(width, elementwise_affine=False) for _ in range(depth)
        )
        self.fcs = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for ln, fc in zip(self.lns, self.fcs, strict=True):
            x = x + fc(ln(x))
        return x


def _attach_warnings(metrics: list[str] | None) -> list[str]:
    model = GainFree()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with normprobe.attach(model, sinks=[normprobe.MemorySink()], metrics=metrics) as probe:
            model(torch.randn(3, 8)).sum().backward()
            probe.step()
    return [str(w.message) for w in caught if w.category is normprobe.DiscoveryWarning]


def test_norms_without_a_learned_gain_are_warned_only_when_norm_gain_is_asked_for() -> None:
    assert _attach_warnings(None) == []
    (warned,) = _attach_warnings(["norm_gain", "resid_rms"])
    assert "no norm layers with a learned gain (norm_gain)" in warned


def test_mobilebert_no_norm_is_no_norm() -> None:
    # MobileBERT's NoNorm is weight * x + bias, named for what it is not
    from transformers import MobileBertConfig, MobileBertModel

    config = MobileBertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        embedding_size=16,
        intra_bottleneck_size=16,
        true_hidden_size=16,
        num_feedforward_networks=1,
    )
    model = MobileBertModel(config)
    assert any(type(m).__name__ == "NoNorm" for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)  # no norms: warned
        m = normprobe.discover(model, input_ids=torch.randint(3, 96, (2, 8)))
    assert [n.class_name for n in m.norms if n.class_name == "NoNorm"] == []
    assert [s.path for s in m.stacks] == ["encoder.layer"]


class NormedValues(nn.Module):
    """Attention with normalized values: the value norm feeds the product of attention weights
    and values, or fused attention's value, never a score."""

    def __init__(self, width: int = 8, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.v_norm = nn.LayerNorm(width)
        self.qk = nn.Linear(width, 2 * width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        v = self.v_norm(self.v(x))
        if self.fused:
            mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            mixed = (q @ k.transpose(-1, -2)).softmax(dim=-1) @ v
        return x + self.out(mixed)


@pytest.mark.parametrize("fused", [False, True])
def test_a_norm_feeding_only_values_is_no_qk_norm(fused: bool) -> None:
    m = normprobe.discover(NormedValues(fused=fused), torch.randn(2, 5, 8))
    assert [(n.path, n.role) for n in m.norms] == [("v_norm", "branch")]


def test_experts_a_router_passed_over_cost_no_second_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    from normprobe.discovery import mapping

    class Experts(nn.Module):
        """Four experts side by side, of which the input picks two."""

        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(Block(8) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.experts[0](x) + self.experts[2](x)

    traces = []
    trace = mapping.trace
    monkeypatch.setattr(mapping, "trace", lambda *a, **k: traces.append(1) or trace(*a, **k))
    normprobe.discover(Experts().train(), torch.randn(2, 5, 8))
    assert len(traces) == 1
    normprobe.discover(SkipsInTraining().train(), torch.randn(2, 5, 8))
    assert len(traces) == 3  # a chain with a block missing: traced again in eval mode


def test_an_add_belongs_to_the_block_performing_it_not_to_a_stack_in_its_branch() -> None:
    # HGNetV2's block adds its input to an aggregation of a chain of convolutions, a stack of
    # its own inside the branch: the add is the block's, in stages.2.blocks
    import timm

    torch.manual_seed(0)
    model = timm.create_model("hgnetv2_b0", pretrained=False, num_classes=4)
    m = normprobe.discover(model, torch.randn(2, 3, 64, 64))
    assert [(a.module, a.stack, a.block) for a in m.residual_adds] == [
        ("stages.2.blocks.1", "stages.2.blocks", 1)
    ]
    assert len(m.adds_in("stages.2.blocks")) == 1


@pytest.mark.slow
def test_a_projection_shortcut_pooled_after_its_layer_is_a_residual_add() -> None:
    # Hiera's stage-changing blocks project the normed input and take the max over the pooled
    # positions (in the block's own forward) as the skip of the attention branch
    import timm

    torch.manual_seed(0)
    model = timm.create_model("hiera_tiny_224", pretrained=False, num_classes=4, img_size=64)
    m = normprobe.discover(model, torch.randn(2, 3, 64, 64))
    per_block = Counter(a.module for a in m.residual_adds)
    assert set(per_block.values()) == {2} and len(per_block) == len(model.blocks)
    assert [(s.path, s.placement) for s in m.stacks] == [("blocks", "pre-ln")]


@pytest.mark.slow
def test_a_term_added_to_attention_from_its_own_values_is_no_residual_add() -> None:
    # EfficientFormerV2's attention returns attn @ v + v_local(v): both sides read v, which
    # the attention computed with a convolution; it is no stream and v_local no shortcut
    import timm

    torch.manual_seed(0)
    model = timm.create_model("efficientformerv2_s0", pretrained=False, num_classes=4, img_size=64)
    m = normprobe.discover(model, torch.randn(2, 3, 64, 64))
    assert not [a.module for a in m.residual_adds if a.module.endswith(".attn")]


@pytest.mark.slow
def test_stacks_without_residual_adds_are_no_residual_whatever_norms_they_hold() -> None:
    # ShuffleNetV2's stages split the channels and concatenate, GoogLeNet's inception branches
    # are two convolutions with BatchNorm in a row, and wav2vec2's feature extractor chains
    # convolutions with LayerNorm: blocks holding norms, no residual add among them
    import torchvision
    from transformers import Wav2Vec2Model

    def placements(model: nn.Module, *inputs: torch.Tensor) -> dict[str, tuple[int, str]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = normprobe.discover(model.eval(), *inputs)
        assert found.norms
        return {s.path: (s.depth, s.placement) for s in found.stacks}

    image = torch.randn(1, 3, 64, 64)
    shufflenet = torchvision.models.shufflenet_v2_x0_5(weights=None)
    assert placements(shufflenet, image) == {
        "stage2": (4, "no-residual"),
        "stage3": (8, "no-residual"),
        "stage4": (4, "no-residual"),
    }
    googlenet = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False)
    found = placements(googlenet, image)
    assert len(found) == 18 and set(found.values()) == {(2, "no-residual")}
    assert "inception3a.branch2" in found

    config = wav2vec2_config(layers=2, layerdrop=0.0)
    config.feat_extract_norm, config.do_stable_layer_norm = "layer", True
    assert placements(Wav2Vec2Model(config), torch.randn(1, 1000)) == {
        "feature_extractor.conv_layers": (2, "no-residual"),
        "encoder.layers": (2, "pre-ln"),
    }


class Odd(nn.Module):
    """A residual block of another class than its neighbours: ``x + fc(ln(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class Stage(nn.Module):
    """A block of an outer stack holding a Sequential of inner blocks."""

    def __init__(self, *inner: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.blocks(x)


def test_a_run_of_one_class_with_an_odd_last_block_is_one_stack_inside_a_block() -> None:
    # EdgeNeXt's third stage: five ConvBlocks and a SplitTransposeBlock in one Sequential, in a
    # stage that is itself a block: one stack of six, not a run of five and a stray block
    width = 8
    model = nn.Sequential(*(Stage(Block(width), Block(width), Odd(width)) for _ in range(2)))
    found = {s.path: s.depth for s in normprobe.discover(model, torch.randn(3, width)).stacks}
    assert found == {"": 2, "0.blocks": 3, "1.blocks": 3}
    # one block of each class, none twice in a row, are a block's sublayers (T5's layer list)
    model = nn.Sequential(*(Stage(Block(width), Odd(width)) for _ in range(2)))
    found = {s.path: s.depth for s in normprobe.discover(model, torch.randn(3, width)).stacks}
    assert found == {"": 2}


def test_edgenext_third_stage_is_one_stack_of_six_blocks() -> None:
    import timm

    model = timm.create_model("edgenext_xx_small", pretrained=False, num_classes=10).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = {s.path: s for s in normprobe.discover(model, torch.randn(1, 3, 64, 64)).stacks}
    stage = found["stages.2.blocks"]
    assert stage.depth == 6 and stage.blocks[-1] == "stages.2.blocks.5"
    assert set(stage.block_type.split("/")) == {"ConvBlock", "SplitTransposeBlock"}
    assert "stages.2.blocks[0..4]" not in found


@pytest.mark.slow
def test_dpn_adds_its_branch_to_a_slice_of_the_stream_in_every_block() -> None:
    # timm's DualPathBlock: the stream is [residual channels | dense channels]; each block adds
    # its branch, which reads the whole stream, to the residual channels (x[:, :c] + out[:, :c])
    # and concatenates the rest: one add per block, identity where no projection is made
    import timm

    model = timm.create_model("dpn48b", pretrained=False, num_classes=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = normprobe.discover(model.eval(), torch.randn(1, 3, 64, 64))
    (stack,) = found.stacks
    adds = found.adds_in(stack.path)
    assert [a.block for a in adds] == list(range(stack.depth)) and stack.depth == 16
    stage_starts = {b for b, block in enumerate(stack.blocks) if block.endswith("_1")}
    assert {a.block for a in adds if a.kind == "projection"} == stage_starts
    assert len(stage_starts) == 4

    sink = normprobe.MemorySink()
    with normprobe.attach(model.train(), sinks=[sink], metrics=["resid_rms"], spikes=None) as p:
        model(torch.randn(2, 3, 64, 64)).sum().backward()
        p.step()
    profile = sink.records[0].profiles[normprobe.tags.format("resid_rms", stack.path)]
    assert len(profile) == 16 and all(math.isfinite(v) and v > 0 for v in profile)
