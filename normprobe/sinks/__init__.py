"""Where logged statistics go: a `Sink` receives each logged step's `Record`.

`TensorBoardSink` writes event files (scalars, a custom-scalars layout, depth profiles);
`MemorySink` keeps the records in a list, for tests and notebooks. Any object with the
`Sink` methods can be passed to ``attach(..., sinks=[...])``.
"""

from .log_dir import check_log_dir
from .record import MemorySink, Record, Sink
from .summaries import LOSS_REGEX, PROFILE_PLUGIN, SUMMARY, charts, heatmap_tag, masked_crc32c
from .tensorboard import TensorBoardSink

__all__ = [
    "LOSS_REGEX",
    "PROFILE_PLUGIN",
    "SUMMARY",
    "MemorySink",
    "Record",
    "Sink",
    "TensorBoardSink",
    "charts",
    "check_log_dir",
    "heatmap_tag",
    "masked_crc32c",
]
