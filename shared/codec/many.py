"""Encoding many tensors on a few threads: a tensor larger than a thread's share of the batch
encodes alone on every thread (the C encoder splits it), the others side by side, one a
thread, so that one tensor's Python bookkeeping (which holds the GIL) overlaps another's C
(which releases it). The planes are the same however the work is dealt."""

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shared.codec import native
from shared.codec.format import EncodedTensor
from shared.codec.tensor import default_threads, encode_tensor


def encode_tensors(
    tensors: Mapping[str, torch.Tensor], num_threads: int | None = None
) -> list[EncodedTensor]:
    """encode_tensor of each (name, tensor), in order, on up to num_threads threads."""
    names = list(tensors)
    out: list[EncodedTensor] = []
    encode_lazily(names, lambda n: tensors[n].numel(), tensors.__getitem__, num_threads, out.append)
    return out


def encode_lazily(
    names: Sequence[str],
    num_elements: Callable[[str], int],
    load: Callable[[str], torch.Tensor],
    num_threads: int | None,
    on_encoded: Callable[[EncodedTensor], None],
) -> None:
    """Encodes load(name) for each name, calling on_encoded with each result in the order of
    `names`; a tensor is loaded only when a thread is ready for it."""
    threads = num_threads or default_threads()
    sizes = [num_elements(name) for name in names]
    share = sum(sizes) / threads

    def encode(name: str, n: int) -> EncodedTensor:
        return encode_tensor(load(name), name, num_threads=n)

    with ThreadPoolExecutor(threads) as pool:
        pending: list[Future] = []
        for name, size in zip(names, sizes):
            if threads == 1 or size <= share or size < 2 * native.MIN_CHUNK_ELEMENTS:
                pending.append(pool.submit(encode, name, 1))
                continue
            for future in pending:
                on_encoded(future.result())
            pending = []
            on_encoded(encode(name, threads))
        for future in pending:
            on_encoded(future.result())
