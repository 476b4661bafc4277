"""Errors that name the argument: a log directory that cannot be created, a misspelled metric
(through `attach`, Lightning's `NormProbe` and the Hugging Face callback)."""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hooks import hook_count
from lightning_lm import LM, tokens, trainer

import normprobe
from normprobe.models import TinyTransformer

transformers = pytest.importorskip("transformers")
from transformers import Trainer  # noqa: E402

from normprobe.hf import NormProbeCallback  # noqa: E402

METRIC_MAKERS: dict[str, Callable[[str], Any]] = {
    "attach": lambda name: normprobe.attach(TinyTransformer(depth=1), metrics=[name]),
    "NormProbe": lambda name: normprobe.NormProbe(metrics=[name]),
    "NormProbeCallback": lambda name: NormProbeCallback(metrics=name),
}


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    """A plain file: no directory can be made under it."""
    path = tmp_path / "notes.txt"
    path.write_text("not a directory")
    return path


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody may write to (skips where this user writes anyway, as root does)."""
    path = tmp_path / "locked"
    path.mkdir()
    path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(path, os.W_OK):
        path.chmod(stat.S_IRWXU)
        pytest.skip("this user may write into a read-only directory (root)")
    yield path
    path.chmod(stat.S_IRWXU)


def test_attach_names_a_log_dir_under_a_file(a_file: Path) -> None:
    model = TinyTransformer(depth=1)
    log_dir = str(a_file / "run")
    with pytest.raises(NotADirectoryError) as err:
        normprobe.attach(model, log_dir=log_dir)
    assert str(err.value) == (
        f"log_dir {log_dir!r} cannot hold TensorBoard event files: {str(a_file)!r} is a file, "
        "not a directory; pass a log_dir in a directory you can write to"
    )
    assert hook_count(model) == 0  # nothing left on the model


def test_attach_names_a_read_only_log_dir(read_only: Path) -> None:
    model = TinyTransformer(depth=1)
    with pytest.raises(PermissionError, match=rf"log_dir '{read_only}/run' cannot hold"):
        normprobe.attach(model, log_dir=str(read_only / "run"))
    assert hook_count(model) == 0


def test_a_sink_names_its_log_dir(a_file: Path) -> None:
    with pytest.raises(NotADirectoryError, match=r"log_dir '.*notes\.txt/a/b' cannot hold"):
        normprobe.TensorBoardSink(log_dir=str(a_file / "a" / "b"))


def test_lightning_names_the_default_root_dir(tmp_path: Path, a_file: Path) -> None:
    t = trainer(tmp_path, logger=False, default_root_dir=str(a_file))
    module = LM()
    with warnings.catch_warnings(), pytest.raises(NotADirectoryError) as err:
        warnings.simplefilter("ignore")
        t.fit(module, tokens())
    message = str(err.value)
    assert f"NormProbe's log directory '{a_file}/normprobe_logs'" in message
    assert "is a file, not a directory; set the Trainer's default_root_dir" in message
    assert hook_count(module) == 0


def test_hf_names_its_folder_in_the_output_dir(tmp_path: Path) -> None:
    # the Trainer makes output_dir itself; the callback's folder in it is a file here
    (tmp_path / "normprobe").write_text("not a directory")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", max_steps=1
    )
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))}] * 4
    model = transformers.GPT2LMHeadModel(config)
    hf = Trainer(model=model, args=args, train_dataset=data, callbacks=[NormProbeCallback()])
    with warnings.catch_warnings(), pytest.raises(NotADirectoryError) as err:
        warnings.simplefilter("ignore")
        hf.train()
    message = str(err.value)
    assert f"NormProbeCallback's log directory '{tmp_path}/normprobe'" in message
    assert "is a file, not a directory; set TrainingArguments(output_dir=...)" in message
    assert hook_count(model) == 0


@pytest.mark.parametrize("where", METRIC_MAKERS)
@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("grad_norms", "did you mean 'grad_norm'?"),
        ("resid_rsm", "did you mean 'resid_rms'?"),
        (
            "grad_ratio",
            "'grad_ratio' is a series the 'grad_norm' family writes: metrics=['grad_norm']",
        ),
        ("speed", "no metric has a similar name"),
    ],
)
def test_a_misspelled_metric_gets_the_closest_name_and_the_list(
    where: str, name: str, hint: str
) -> None:
    with pytest.raises(ValueError) as err:
        METRIC_MAKERS[where](name)
    assert str(err.value).startswith(f"unknown metric {name!r} ({hint}); the metrics are ")
    assert str(err.value).endswith(", ".join(normprobe.METRICS))
