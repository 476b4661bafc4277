"""The scheme registry: each scheme declares its name, options and documentation once, and
`reinit` takes all three from there (its options check, its docstring, its errors)."""

from __future__ import annotations

import inspect
import re

import pytest
from torch import nn

import normprobe
from normprobe.reinit import SCHEMES, reinit
from normprobe.reinit.schemes import REGISTRY


def test_reinit_and_mup_stay_functions_beside_their_packages() -> None:
    assert inspect.isfunction(normprobe.reinit) and normprobe.reinit is reinit
    assert inspect.isfunction(normprobe.mup)


def test_the_registry_lists_every_scheme_in_its_order() -> None:
    assert SCHEMES == ("gpt2", "fixup", "deepnorm", "kaiming", "xavier", "zero_branch")
    assert all(REGISTRY[name].name == name for name in SCHEMES)


@pytest.mark.parametrize("name", SCHEMES)
def test_a_scheme_is_documented_once_in_reinit(name: str) -> None:
    scheme = REGISTRY[name]
    assert scheme.doc, f"{name} has no docstring"
    doc = reinit.__doc__ or ""
    entries = re.findall(rf"^    \* ``{name}``", doc, flags=re.MULTILINE)
    assert len(entries) == 1, f"{name} is listed {len(entries)} times"
    entry = doc.split(f"* ``{name}``", 1)[1].split("\n    * ", 1)[0].split("\n\n", 1)[0]
    for option, default in scheme.options.items():
        assert f"``{option}={default!r}``" in entry
    assert " ".join(scheme.doc.split()[:6]) in " ".join(entry.split())


@pytest.mark.parametrize("name", SCHEMES)
def test_a_scheme_takes_exactly_the_options_its_function_declares(name: str) -> None:
    scheme = REGISTRY[name]
    params = inspect.signature(scheme.apply).parameters.values()
    declared = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    assert list(scheme.options) == declared
    with pytest.raises(ValueError, match="has no option 'bogus'") as err:
        reinit(nn.Linear(2, 2), name, bogus=1)
    assert str(sorted(declared) or "none") in str(err.value)


def test_an_unknown_scheme_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown init scheme 'nope'") as err:
        reinit(nn.Linear(2, 2), "nope")
    assert all(repr(name) in str(err.value) for name in SCHEMES)
