"""Every Python block of the README runs as written; a block marked ``<!-- sketch: why -->``
(it needs the reader's own model or data) is only compiled."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
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


@pytest.mark.parametrize(("line", "code", "why"), _blocks(), ids=lambda v: str(v)[:8])
def test_readme_block(tmp_path: Path, line: int, code: str, why: str | None) -> None:
    compile(code, f"README.md:{line}", "exec")  # every block is valid Python
    if why is not None:
        pytest.skip(f"README.md:{line} is a sketch: {why}")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"README.md:{line}\n{done.stderr[-3000:]}"
