"""Every Python block of the README and of the documentation pages (`docs/**/*.md`) runs as
written; a block marked ``<!-- sketch: why -->`` (it needs the reader's own model or data) is only
compiled. A block that appears in several places (the README's quickstart is also a guide's) runs
once."""

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

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"(?:<!-- sketch: (?P<why>[^>]*) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """(``path:line``, code, why it is a sketch or None) of each Python block of ``page``."""
    text = page.read_text()
    name = page.relative_to(ROOT).as_posix()
    return [
        (f"{name}:{text.count(chr(10), 0, m.start('code')) + 1}", m["code"], m["why"])
        for m in _BLOCK.finditer(text)
    ]


def _distinct() -> list[tuple[str, str, str | None]]:
    """Every page's blocks, each distinct code once: under the first place it runs, else the
    first place it appears."""
    seen: dict[str, tuple[str, str, str | None]] = {}
    for page in PAGES:
        for where, code, why in _blocks(page):
            if code not in seen or (seen[code][2] is not None and why is None):
                seen[code] = (where, code, why)
    return list(seen.values())


def test_the_readme_and_the_pages_have_runnable_blocks() -> None:
    readme = _blocks(README)
    assert len(readme) >= 3 and sum(why is None for _, _, why in readme) >= 1
    blocks = _distinct()
    assert len(blocks) >= 15 and sum(why is None for _, _, why in blocks) >= 6


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/metrics.md", "docs/guides/plain-pytorch.md"} <= names


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("where", "code", "why"), [pytest.param(*block, id=block[0]) for block in _distinct()]
)
def test_doc_block(tmp_path: Path, where: str, code: str, why: str | None) -> None:
    compile(code, where, "exec")  # every block is valid Python
    if why is not None:
        pytest.skip(f"{where} is a sketch: {why}")
    # threads that sleep when idle (as test_claims.py): spinning ones slow small models many
    # times over when the cores are shared
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{where}\n{done.stderr[-3000:]}"


def _reading_lines() -> str:
    """The lines of the README's first runnable block that read the probe after its loop."""
    code = next(code for _, code, why in _blocks(README) if why is None)
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
