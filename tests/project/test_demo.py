"""`make demo` trains four runs through Lightning with NormProbe and compares them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tb import read_events

import normprobe
from normprobe import demo, tags


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Torch on the two threads of a 2-core machine, as a user's session has them (the tests run
    on one), so that the demo's own thread setting shows."""
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


@pytest.mark.slow
@pytest.mark.usefixtures("two_threads")
def test_demo_trains_four_runs_and_prints_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo.main(["--steps", "8", "--root", str(tmp_path)])
    assert torch.get_num_threads() == 2  # the demo's one thread is its own
    out = capsys.readouterr().out
    # what it will take is said first: 4 runs of (3 s + 8 steps of 0.1 s)
    assert out.splitlines()[0] == "normprobe demo: 4 runs of 8 steps, about 15 s on 2 CPU cores"
    assert demo.expected_seconds(300) == pytest.approx(4 * (3 + 300 * 0.1))
    assert out.splitlines()[-1].startswith("The demo took ")
    for name in demo.RUNS:
        events = read_events(str(tmp_path / "demo" / name))
        assert tags.format("grad_ratio", "model.blocks") in events.scalars
        assert any(line.startswith(name + " ") for line in out.splitlines())
    assert f"tensorboard --logdir {tmp_path / 'demo'}" in out
    # the link pins the summary of the four runs: the loss and the stack's gradient ratio first
    link = next(line for line in out.splitlines() if line.startswith("http://localhost:6006/?"))
    assert link == normprobe.dashboard_url(tmp_path / "demo")
    assert "train_loss" in link and "grad_ratio" in link
    table = [line.split() for line in out.splitlines() if line.startswith(("pre-ln", "post-ln"))]
    assert len(table) == 4 and all(len(row) == 6 for row in table)  # ms/step last
    assert all(float(v) == float(v) for row in table for v in row[1:])  # measured, not NaN


@pytest.mark.slow
@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(("argv", "threads"), [([], 1), (["--threads", "2"], 2)])
def test_the_demo_trains_on_one_thread_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], threads: int
) -> None:
    seen: list[int] = []
    make = demo.RUNS["pre-ln"]

    def pre_ln(vocab: int) -> torch.nn.Module:
        seen.append(torch.get_num_threads())  # while the run is being set up and trained
        return make(vocab)

    monkeypatch.setattr(demo, "RUNS", {"pre-ln": pre_ln})
    before = torch.get_num_threads()
    demo.main(["--steps", "2", "--root", str(tmp_path), *argv])
    assert seen == [threads] and torch.get_num_threads() == before


def _operations(name: str, probed: bool) -> int:
    """The torch operations one unlogged training step of a demo model runs."""
    model = demo.RUNS[name](96)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (2, 16))
    sinks = [normprobe.MemorySink()]
    probe = normprobe.attach(model, opt, sinks=sinks, every=50) if probed else None

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()

    step()  # step 0, logged
    with torch.autograd.profiler.profile() as prof:
        step()  # step 1, not logged
    if probe is not None:
        probe.remove()
    return sum(e.count for e in prof.key_averages())


@pytest.mark.slow
def test_no_demo_run_does_much_more_work_per_step() -> None:
    # a run 10x slower than the others on CPU: counted in operations, not seconds. The
    # probe adds the same work to every model's unlogged step (its spike detector), none for
    # converted norms; nn.RMSNorm's backward on CPU is a few operations more than LayerNorm's.
    bare = {name: _operations(name, probed=False) for name in demo.RUNS}
    added = {name: _operations(name, probed=True) - bare[name] for name in demo.RUNS}
    assert len(set(added.values())) == 1 and 0 < added["pre-ln"] < 0.05 * bare["pre-ln"]
    assert bare["pre-ln"] < bare["pre-ln-rmsnorm"] < 1.1 * bare["pre-ln"]
