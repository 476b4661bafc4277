"""The ``gpt2`` scheme: N(0, std), the weights writing into the residual stream std/sqrt(2N)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..branches import check_skip_gains
from ..report import normal
from ..scheme import Scheme, block_count, positive_number
from ..target import Target
from ..weights import warn_user


def gpt2(t: Target, *, std: Any = 0.02, n_layers: Any = None) -> None:
    """Every weight N(0, std); every weight that writes into the residual stream (each add's
    ``writer_params``: both projections of a parallel block, every expert's down projection)
    N(0, std/sqrt(2N)), N the blocks of its stack, or the runs of a repeated block (or
    ``n_layers``); biases 0; norm gains 1 and biases 0 (a norm of unknown kind is left as it is).
    """
    std = positive_number("std (sigma)", std)
    n = block_count("n_layers", n_layers)
    # the weights writing into the residual stream get std/sqrt(2N), per the GPT-2 paper
    adds = t.adds()
    check_skip_gains(t, adds, unit_ok=True)
    writers = {q: (n or t.depth(a)) for a in adds for q in a.writer_params}
    for a in adds:
        if a.branch_layers and (not a.writers or a.open_path):  # a weightless one has no std
            warn_user(
                f"{t.what}: the branch of the residual add {a.module or '<root>'}#{a.ordinal} "
                + (
                    "has no weight layer writing into the stream"
                    if not a.writers
                    else "reaches the add on a path without a weight layer"
                )
                + "; what it adds keeps std, not std/sqrt(2N)"
            )
    seen: set[int] = set()
    with torch.no_grad():
        for path, m in t.weight_layers():
            for name, p in t.applied.of(m):
                if id(p) in seen:
                    continue  # a tied weight (lm_head = wte) is initialized once
                seen.add(id(p))
                if t.drawn(name, p):
                    depth = writers.get(f"{path}.{name}" if path else name)
                    scale = math.sqrt(2 * depth) if depth else 1.0
                    nn.init.normal_(p, 0.0, std / scale)
                    why = f"{std:g}/sqrt(2*{depth})" if depth else f"std={std:g}"
                    t.rec.record(p, normal(std / scale, why))
                else:
                    t.set_vector(name, p, "gpt2")
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                dict(t.applied.of(m))["weight"][m.padding_idx].zero_()
                t.rec.notes.append(f"{path}.weight: row {m.padding_idx} (padding_idx) set to 0")
    t.reset_norms()


SCHEME = Scheme(
    "gpt2", gpt2, branches=True, counts_depth=lambda options: options["n_layers"] is None
)
