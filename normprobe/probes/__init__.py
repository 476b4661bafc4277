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
    row_norms,
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
from .base import feature_dim, plain, same_values, sample_stride
from .outliers import MEDIAN_SAMPLE, OutlierParts, outlier_parts, outlier_stats, outlier_stats_many
from .shards import is_sharded, local, local_part, shard_share
from .squares import (
    CHUNK,
    SMALL_NUMEL,
    ByShape,
    SquareSums,
    group_sums,
    squared_norms,
    strided_samples,
    strided_views,
)

__all__ = [
    "CHUNK",
    "MEDIAN_SAMPLE",
    "SAMPLE_ROWS",
    "SAMPLE_SHARE",
    "SMALL_NUMEL",
    "ByShape",
    "OutlierParts",
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
    "outlier_stats",
    "outlier_stats_many",
    "plain",
    "rms",
    "rms_from_row_norms",
    "rms_many",
    "row_dots",
    "row_norms",
    "same_values",
    "sample_stride",
    "sdpa_logit_max",
    "shard_share",
    "squared_norms",
    "strided_samples",
    "strided_views",
]
