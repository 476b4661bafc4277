"""Every Python block of the README runs as written; a block marked ``<!-- sketch: why -->``
(it needs the reader's own model or data) is only compiled."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import normprobe
from normprobe import tags

README = Path(__file__).parents[2] / "README.md"
_BLOCK = re.compile(r"(?:<!-- sketch: (?P<why>[^>]*) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks() -> list[tuple[int, str, str | None]]:
    text = README.read_text()
    return [
        (text.count("\n", 0, m.start("code")) + 1, m["code"], m["why"])
        for m in _BLOCK.finditer(text)
    ]


def test_the_readme_has_runnable_blocks() -> None:
    blocks = _blocks()
    assert len(blocks) >= 8 and sum(why is None for _, _, why in blocks) >= 4


@pytest.mark.subprocess
@pytest.mark.parametrize(("line", "code", "why"), _blocks(), ids=lambda v: str(v)[:8])
def test_readme_block(tmp_path: Path, line: int, code: str, why: str | None) -> None:
    compile(code, f"README.md:{line}", "exec")  # every block is valid Python
    if why is not None:
        pytest.skip(f"README.md:{line} is a sketch: {why}")
    # threads that sleep when idle (as test_claims.py): spinning ones slow small models many
    # times over when the cores are shared
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"README.md:{line}\n{done.stderr[-3000:]}"


def _reading_lines() -> str:
    """The lines of the README's first runnable block that read the probe after its loop."""
    code = next(code for _, code, why in _blocks() if why is None)
    lines = [line for line in code.splitlines() if line.startswith("print(probe")]
    assert len(lines) >= 2
    return "\n".join(lines)


def _hf_model(name: str) -> tuple[nn.Module, nn.ModuleList, str]:
    """A Hugging Face model from a small config (random weights), its stack and its stack's
    tag name."""
    transformers = pytest.importorskip("transformers")
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        llama = transformers.LlamaForCausalLM(config)
        return llama, llama.model.layers, "model.layers"
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=4)
    gpt2 = transformers.GPT2LMHeadModel(config)
    return gpt2, gpt2.transformer.h, "transformer.h"


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_readme_reads_a_hugging_face_model_as_written(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model, blocks, stack = _hf_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = normprobe.MemorySink()
    with normprobe.attach(model, optimizer=opt, sinks=[sink], every=2) as probe:
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            # the last step is logged: its ratio by hand, from the gradients the optimizer gets
            first, last = (
                math.sqrt(sum(float(p.grad.square().sum()) for p in block.parameters()))
                for block in (blocks[0], blocks[-1])
            )
            opt.step()
            opt.zero_grad()
    exec(_reading_lines(), {"probe": probe})
    record = probe.latest
    assert record is not None and record.step == 2
    assert probe.stacks == record.stacks == [stack]
    assert record.grad_ratio() == pytest.approx(last / first, rel=1e-4)
    assert record.grad_ratio() == record.scalars[tags.format("grad_ratio", stack)]
    assert record.resid_growth() == record.scalars[tags.format("resid_growth", stack)]
    assert capsys.readouterr().out.splitlines() == [
        f"2 {record.grad_ratio()}",
        f"['{stack}'] {record.resid_growth()}",
    ]
