"""`make demo` runs the demo module: it must keep printing real maps."""

from __future__ import annotations

import pytest

from normprobe import demo


def test_demo_prints_a_map_per_model(capsys: pytest.CaptureFixture[str]) -> None:
    demo.main()
    out = capsys.readouterr().out
    assert out.count("ModelMap of ") == 4
    assert "lns.{0..47}  layernorm  pre" in out
    assert "post-ln+qk-norm" in out
    assert "LlamaRMSNorm" in out and "projection" in out
