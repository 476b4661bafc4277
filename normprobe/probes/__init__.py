"""The statistics normprobe logs, as pure tensor functions.

Every function reduces in float32 and returns tensors on the input's device: nothing here
reads a value back to the host.
"""

from .activations import (
    batchnorm_stats,
    cosines_from_rows,
    finite_sum,
    finite_sums,
    gain_from_moments,
    gain_moments,
    gain_stats,
    loglog_slope,
    mean_cosine,
    rms,
    rms_from_row_norms,
    rms_many,
    row_dots,
    row_dots_many,
    row_norms,
    row_norms_many,
)
from .attention import (
    SAMPLE_ROWS,
    SAMPLE_SHARE,
    abs_max,
    head_abs_max,
    logit_sample,
    logit_stats,
    mha_logit_max,
    mha_qk,
    sdpa_logit_max,
)
from .base import feature_dim, group_sums, plain, same_values, sample_stride, wide_dtype
from .outliers import (
    MEDIAN_SAMPLE,
    OutlierParts,
    outlier_parts,
    outlier_parts_many,
    outlier_stats,
    outlier_stats_many,
)
from .samples import Copy, SampledCopy
from .shards import is_sharded, local, local_part, shard_share
from .squares import (
    CHUNK,
    SMALL_NUMEL,
    ByShape,
    SquareSums,
    squared_norms,
)

__all__ = [
    "CHUNK",
    "MEDIAN_SAMPLE",
    "SAMPLE_ROWS",
    "SAMPLE_SHARE",
    "SMALL_NUMEL",
    "ByShape",
    "Copy",
    "OutlierParts",
    "SampledCopy",
    "SquareSums",
    "abs_max",
    "batchnorm_stats",
    "cosines_from_rows",
    "feature_dim",
    "finite_sum",
    "finite_sums",
    "gain_from_moments",
    "gain_moments",
    "gain_stats",
    "group_sums",
    "head_abs_max",
    "is_sharded",
    "local",
    "local_part",
    "logit_sample",
    "logit_stats",
    "loglog_slope",
    "mean_cosine",
    "mha_logit_max",
    "mha_qk",
    "outlier_parts",
    "outlier_parts_many",
    "outlier_stats",
    "outlier_stats_many",
    "plain",
    "rms",
    "rms_from_row_norms",
    "rms_many",
    "row_dots",
    "row_dots_many",
    "row_norms",
    "row_norms_many",
    "same_values",
    "sample_stride",
    "sdpa_logit_max",
    "shard_share",
    "squared_norms",
    "wide_dtype",
]
