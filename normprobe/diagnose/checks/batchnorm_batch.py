"""``batchnorm-batch``: BatchNorm on a small per-device batch, or unsynced across ranks."""

from __future__ import annotations

from torch import nn

from ..result import Finding
from .base import Check, CheckResult, Context, collapse_paths

CODE = "batchnorm-batch"

# BatchNorm's batch statistics come from m samples with a variance ∝ 1/m; batches of 2-4 per
# device are where BN degrades badly and GroupNorm takes over (Wu & He 2018, "Group
# Normalization"). 8 keeps a margin above that.
BN_MIN_BATCH = 8


def check(ctx: Context) -> CheckResult:
    if not ctx.cap.bn_batch:
        return [], "no BatchNorm in training mode"
    modules = dict(ctx.model.named_modules())
    synced = {p for p in ctx.cap.bn_batch if isinstance(modules[p], nn.SyncBatchNorm)}
    small = {
        p: b
        for p, b in ctx.cap.bn_batch.items()
        if b * (ctx.world_size if p in synced else 1) < BN_MIN_BATCH
    }
    found = []
    if small:
        found.append(_small_batch(ctx, small))
    unsynced = sorted(p for p in ctx.cap.bn_batch if p not in synced)
    if ctx.world_size > 1 and unsynced:
        found.append(
            Finding(
                CODE,
                "BatchNorm is not synchronized across data-parallel ranks",
                (
                    f"{ctx.world_size} ranks; {len(unsynced)} BatchNorm layers normalize over "
                    f"their own rank's {min(ctx.cap.bn_batch[p] for p in unsynced)} samples: "
                    f"{collapse_paths(unsynced)}",
                ),
                "convert them before wrapping the model in DDP: "
                "normprobe.convert_norms(model, 'syncbatchnorm') (or torch's "
                "SyncBatchNorm.convert_sync_batchnorm), or use GroupNorm.",
                tuple(unsynced),
            )
        )
    return found, None


def _small_batch(ctx: Context, small: dict[str, int]) -> Finding:
    batch = min(small.values())
    ctx.extra["diagnose/bn_batch"] = float(batch)
    return Finding(
        CODE,
        "BatchNorm normalizes over a tiny batch",
        (
            f"{len(small)} BatchNorm layers see a batch of {batch} per device (below "
            f"{BN_MIN_BATCH}): {collapse_paths(sorted(small))}",
        ),
        "batch statistics from so few samples are noisy and differ from the running "
        "ones used in eval: use GroupNorm (normprobe.convert_norms(model, 'groupnorm')), "
        "a larger batch, or SyncBatchNorm across devices.",
        tuple(sorted(small)),
    )


CHECK = Check(
    CODE,
    "BatchNorm on a small per-device batch, or unsynced across ranks",
    {"BN_MIN_BATCH": BN_MIN_BATCH},
    check,
)
