"""The names `convert_norms` takes: its targets, the policy keys that are roles or positions,
and the ready-made `HYBRIDNORM` policy."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

Target = Literal[
    "layernorm", "rmsnorm", "groupnorm", "batchnorm", "syncbatchnorm", "dyt", "identity"
]
TARGETS: tuple[Target, ...] = (
    "layernorm",
    "rmsnorm",
    "groupnorm",
    "batchnorm",
    "syncbatchnorm",
    "dyt",
    "identity",
)
ROLES = ("pre", "post", "sandwich-post", "qk", "final", "branch", "other")
POSITIONS = ("post-attention", "post-ffn")
HYBRIDNORM: Mapping[str, Target | None] = MappingProxyType(
    {"post-attention": "layernorm", "*": "rmsnorm"}
)
"""LayerNorm right after attention, RMSNorm everywhere else: norm kinds mixed by position, named
after HybridNorm (Zhuo et al. 2025), whose own block mixes placements instead (QKV normalization
in attention, Post-Norm in the feed-forward)."""

Policy = Mapping[str, Target | str | None]

ALIASES: dict[str, Target] = {t: t for t in TARGETS} | {"dynamictanh": "dyt"}
CLASS_NAMES: dict[Target, str] = {
    "layernorm": "LayerNorm",
    "rmsnorm": "RMSNorm",
    "groupnorm": "GroupNorm",
    "batchnorm": "BatchNorm",
    "syncbatchnorm": "SyncBatchNorm",
    "dyt": "DyT",
    "identity": "Identity",
}
"""How messages name each target's layer."""
