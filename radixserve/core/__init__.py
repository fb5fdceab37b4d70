"""Plain data shared by every layer: sampling parameters, forward batches."""

from radixserve.core.batch import ForwardBatch, ForwardMode
from radixserve.core.sampling_params import SamplingParams

__all__ = ["ForwardBatch", "ForwardMode", "SamplingParams"]
