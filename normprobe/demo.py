"""`make demo`: print what normprobe discovers in a few models, all built locally, no downloads."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .discovery import discover
from .models import ResidualStack, TinyTransformer

Example = tuple[str, Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]]


def _examples() -> Iterator[Example]:
    tokens = torch.randint(0, 96, (2, 32))
    yield (
        "The tutorial's 48-block Pre-LN stack",
        lambda: (ResidualStack(48, 64, pre_ln=True), (torch.randn(16, 64),), {}),
    )
    yield (
        "A small GPT-style transformer, Post-LN with QK-norm",
        lambda: (TinyTransformer(placement="post", qk_norm=True), (tokens,), {}),
    )
    if importlib.util.find_spec("transformers") is not None:
        yield "Hugging Face Llama (4 layers, random weights)", _llama
    if importlib.util.find_spec("timm") is not None:
        yield "timm ResNet-18 (random weights)", _resnet


def _llama() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, 128, (2, 16))
    return transformers.LlamaForCausalLM(config), (), {"input_ids": ids, "use_cache": False}


def _resnet() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    import timm

    return timm.create_model("resnet18", num_classes=10), (torch.randn(2, 3, 64, 64),), {}


def main() -> None:
    torch.manual_seed(0)
    for title, build in _examples():
        model, args, kwargs = build()
        print(f"\n=== {title}\n{discover(model, *args, **kwargs)}")


if __name__ == "__main__":
    main()
