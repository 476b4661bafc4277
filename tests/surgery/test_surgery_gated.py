"""convert_norms refuses gated norms (forward(x, gate)): their replacement could not take a gate."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe

VOCAB = 96


def _mamba2() -> nn.Module:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=16,
        state_size=8,
        n_groups=1,
        expand=2,
        chunk_size=8,
    )
    return Mamba2ForCausalLM(config)


def _qwen3_next() -> nn.Module:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=2,
        num_experts_per_tok=1,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    return Qwen3NextForCausalLM(config)


def _zamba2() -> nn.Module:
    from transformers import Zamba2Config, Zamba2ForCausalLM

    config = Zamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        layers_block_type=["mamba", "hybrid"],
        hybrid_layer_ids=[1],
        num_attention_heads=2,
        num_key_value_heads=2,
        attention_head_dim=16,
        intermediate_size=64,
        mamba_d_state=8,
        mamba_headdim=16,
        mamba_ngroups=1,
        n_mamba_heads=4,
        chunk_size=8,
    )
    return Zamba2ForCausalLM(config)


HF_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "mamba2": _mamba2,
    "qwen3_next": _qwen3_next,
    "zamba2": _zamba2,
}


class GatedRMSNorm(nn.Module):
    """A user's gated RMSNorm: the gate is a second, required input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_hat * F.silu(gate)


class OptionsRMSNorm(nn.Module):
    """A plain RMSNorm whose forward also takes options that are not tensors."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = 1e-6

    def forward(
        self, x: torch.Tensor, eps: float | None = None, upcast: bool = True
    ) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if upcast else x
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + (eps or self.eps))
        return self.weight * x_hat.to(dtype)


class GatedBlock(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = OptionsRMSNorm(dim)
        self.proj = nn.Linear(dim, 2 * dim)
        self.gated = GatedRMSNorm(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gate = self.proj(self.norm(x)).chunk(2, dim=-1)
        return x + self.out(self.gated(h, gate))


def _hf_model(family: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = HF_BUILDERS[family]()
    return model.eval(), {"input_ids": torch.randint(0, VOCAB, (2, 8))}


def _user_model() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(GatedBlock(), GatedBlock()), {"input": torch.randn(2, 5, 8)}


def _gated_paths(model: nn.Module) -> list[str]:
    names = {n: type(m).__name__ for n, m in model.named_modules()}
    return [n for n, cls in names.items() if "Gated" in cls and "Norm" in cls]


def _refusal(model: nn.Module, inputs: dict[str, torch.Tensor]) -> str:
    """The error of converting every norm to RMSNorm, after checking that nothing changed."""
    state = model.state_dict(keep_vars=True)
    values = {k: v.detach().clone() for k, v in state.items()}
    types = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ValueError) as err:
        normprobe.convert_norms(model, "rmsnorm", example_kwargs=inputs)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(state)
    assert all(after[k] is state[k] and torch.equal(after[k], values[k]) for k in state)
    assert [(n, type(m)) for n, m in model.named_modules()] == types
    return str(err.value)


def _way_out(message: str, how: str) -> dict[str, object]:
    """The keyword arguments the refusal suggests: ``exclude=`` or a policy mapping to None."""
    if how == "exclude":
        found = re.search(r"exclude=('[^']*')", message)
        assert found, message
        return {"target": "rmsnorm", "exclude": ast.literal_eval(found.group(1))}
    found = re.search(r"mapping it to None: (\{.*?\})", message)
    assert found, message
    return {"target": ast.literal_eval(found.group(1))}


def _train_step(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    model.train()
    out = model(**inputs)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    logits.float().pow(2).mean().backward()
    return logits.detach()


@pytest.mark.parametrize("family", list(HF_BUILDERS))
def test_hf_gated_norms_are_refused_and_nothing_changes(family: str) -> None:
    model, inputs = _hf_model(family)
    gated = _gated_paths(model)
    assert gated
    message = _refusal(model, inputs)
    cls = type(model.get_submodule(gated[0])).__name__
    assert f"{gated[0]} ({cls}) is a gated norm" in message
    assert "gate besides the tensor it normalizes" in message
    assert all(path in message for path in gated)
    assert "exclude=" in message and "nothing was changed" in message
    model(**inputs)  # the model still runs as it was


@pytest.mark.parametrize("how", ["exclude", "policy"])
@pytest.mark.parametrize("family", list(HF_BUILDERS))
def test_hf_way_out_converts_the_other_norms(family: str, how: str) -> None:
    model, inputs = _hf_model(family)
    gated = {p: type(model.get_submodule(p)) for p in _gated_paths(model)}
    with torch.no_grad():
        before = model(**inputs).logits
    kwargs = _way_out(_refusal(model, inputs), how)
    model, report = normprobe.convert_norms_with_report(model, example_kwargs=inputs, **kwargs)
    assert {p: type(model.get_submodule(p)) for p in gated} == gated
    assert report.conversions and not {c.path for c in report.conversions} & set(gated)
    assert all(isinstance(model.get_submodule(c.path), nn.RMSNorm) for c in report.conversions)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before, rtol=1e-4, atol=1e-4)
    _train_step(model, inputs)
    for path in [*gated, *(c.path for c in report.conversions)]:
        grad = model.get_submodule(path).weight.grad
        assert grad is not None and torch.isfinite(grad).all(), path


def test_user_gated_norm_is_refused() -> None:
    model, inputs = _user_model()
    message = _refusal(model, inputs)
    assert "0.gated (GatedRMSNorm) is a gated norm: its forward takes gate" in message
    assert "1.gated" in message and "norm (OptionsRMSNorm)" not in message
    assert "exclude='*.gated'" in message
    assert "{'*.gated': None, '*': 'rmsnorm'}" in message


@pytest.mark.parametrize("how", ["exclude", "policy"])
def test_user_norm_with_non_tensor_options_still_converts(how: str) -> None:
    model, inputs = _user_model()
    with torch.no_grad():
        before = model(**inputs)
    kwargs = _way_out(_refusal(model, inputs), how)
    model, report = normprobe.convert_norms_with_report(model, example_kwargs=inputs, **kwargs)
    assert sorted(c.path for c in report.conversions) == ["0.norm", "1.norm"]
    assert all(isinstance(block.norm, nn.RMSNorm) for block in model)
    assert all(isinstance(block.gated, GatedRMSNorm) for block in model)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs), before)
    _train_step(model, inputs)
    assert all(block.norm.weight.grad is not None for block in model)
