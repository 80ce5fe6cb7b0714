"""Tison's lossless weight codec: canonical-Huffman-coded exponents (plus the top mantissa
bits), raw sign and low mantissa, cut into segments that decode in parallel on CPU threads
or GPU threads (gpu.py). The format is specified in FORMAT.md."""

from shared.codec.checkpoint import CompressedCheckpoint, is_compressed_dir
from shared.codec.folder import (
    TensorRecord,
    compress_dir,
    decompress_dir,
    inspect_dir,
    tensor_class,
)
from shared.codec.format import FORMAT_VERSION, CodedPlanes, EncodedTensor
from shared.codec.many import encode_tensors
from shared.codec.tensor import decode_tensor, decode_tensors, encode_tensor

__all__ = [
    "FORMAT_VERSION",
    "CodedPlanes",
    "CompressedCheckpoint",
    "EncodedTensor",
    "TensorRecord",
    "compress_dir",
    "decode_tensor",
    "decode_tensors",
    "decompress_dir",
    "encode_tensor",
    "encode_tensors",
    "inspect_dir",
    "is_compressed_dir",
    "tensor_class",
]
