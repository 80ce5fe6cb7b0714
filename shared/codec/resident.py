"""Tensors kept encoded and decoded again and again into the same outputs: a model's resident
weights (shared/models/resident.py) decode each layer's just before the layer runs.
`FixedDecode` does the per-call planning once, at construction: on the CPU the C decoder's job
list (planes and outputs never move, so a call is one tc_decode_batch on all threads); on CUDA
each tensor's launch plan (code table, raw layout: read on the host), its planes moved to the
GPU once, for gpu.decode_on_device."""

import torch

from shared.codec import native
from shared.codec.format import EncodedTensor
from shared.codec.tensor import _corrupt, _job, decode_tensors, default_threads, full_lengths


class FixedDecode:
    """decode(pairs[i][0]) written into pairs[i][1] at each call. Each output: contiguous, the
    encoded tensor's shape and dtype, on the device every output shares (a view into a
    scratch buffer, say); the planes (or a raw tensor's data) are moved there once. The planes
    were checked when read (CompressedCheckpoint.get_encoded: sizes, code table, CRC-32C), so
    calls skip the output CRC; the decoder's structural checks still raise ModelFolderError."""

    def __init__(self, pairs: list[tuple[EncodedTensor, torch.Tensor]]):
        if not pairs:
            raise ValueError("FixedDecode of no tensors")
        self.device = pairs[0][1].device
        for encoded, out in pairs:
            if (
                tuple(out.shape) != encoded.shape
                or out.dtype != encoded.dtype
                or out.device != self.device
                or not out.is_contiguous()
            ):
                raise ValueError(
                    f"{encoded.name}: {encoded.dtype}{list(encoded.shape)} cannot decode into "
                    f"{out.dtype}{list(out.shape)} on {out.device} (contiguous: "
                    f"{out.is_contiguous()})"
                )
        coded = [(e, out) for e, out in pairs if e.planes is not None]
        self._raw = [(e.data.to(self.device), out) for e, out in pairs if e.planes is None]
        self._stored = sum(e.stored_nbytes() for e, _ in pairs)
        self._lib, self._jobs = None, None
        if self.device.type == "cuda":
            from shared.codec.gpu import plan  # kernels.cuda: imported where a GPU decodes

            self._coded = [(e.to(self.device), out, plan(e)) for e, out in coded]
            return
        for encoded, _ in coded:
            full_lengths(encoded)  # sizes and code table, ModelFolderError naming the tensor
        self._coded = [(e, out, None) for e, out in coded]
        self._lib = native.load()
        if self._lib is not None and coded:
            self._jobs = (native.Job * len(coded))(*(_job(e, out) for e, out in coded))

    def nbytes(self) -> int:
        """Bytes the encoded tensors hold (planes, or a raw tensor's data)."""
        return self._stored

    def __call__(self) -> None:
        """Decodes every tensor into its output (on CUDA: on torch's current stream)."""
        for data, out in self._raw:
            out.copy_(data)
        if self.device.type == "cuda":
            from shared.codec.gpu import decode_on_device

            for encoded, out, launch in self._coded:
                decode_on_device(encoded, out, launch)
        elif self._jobs is not None:
            status = self._lib.tc_decode_batch(self._jobs, len(self._jobs), default_threads(), 0)
            if status == native.NO_MEMORY:
                raise MemoryError("codec: no memory for the decoder's bookkeeping")
            for job, (encoded, _, _) in zip(self._jobs, self._coded):
                if job.status != 0:
                    problem = native.PROBLEMS.get(job.status, f"decoder status {job.status}")
                    raise _corrupt(encoded, problem)
        elif self._coded:  # no C decoder here: the numpy reference, then a copy
            decoded = decode_tensors([e for e, _, _ in self._coded], verify=False)
            for tensor, (_, out, _) in zip(decoded, self._coded):
                out.copy_(tensor)
