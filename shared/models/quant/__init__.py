"""Quantized checkpoints (FP8 block-scaled, compressed-tensors INT4 pack-quantized) loaded as
dense weights: open_checkpoint() is the loader's one entry point."""

from shared.models.quant.checkpoint import QuantizedCheckpoint, open_checkpoint
from shared.models.quant.scheme import QuantScheme, read_scheme

__all__ = ["QuantScheme", "QuantizedCheckpoint", "open_checkpoint", "read_scheme"]
