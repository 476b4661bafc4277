"""transformers' OLMo-2 at width 64, trained a few AdamW steps under a probe: its post norms'
eps outweighs the first blocks' small branch outputs at init, a healthy run whose stream
profile tests the residual flags against."""

from __future__ import annotations

from pathlib import Path

import torch

import normprobe


def train_olmo2(log_dir: Path, layers: int, steps: int, batch: tuple[int, int]) -> None:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(0)
    config = Olmo2Config(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = Olmo2ForCausalLM(config)
    data = torch.randint(3, 128, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with normprobe.attach(model, opt, log_dir=str(log_dir), every=1):
        for _ in range(steps):
            model(input_ids=data, labels=data, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()
