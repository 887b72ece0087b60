"""jtbo.split: host planning of the TBO split and pure split/merge of batch pytrees."""

from jtbo.split.batch import ForwardBatch, SpecVerifyInput
from jtbo.split.forward_mode import ForwardMode

__all__ = [
    "ForwardBatch",
    "ForwardMode",
    "SpecVerifyInput",
]
