"""Check `kernels`: every CUDA kernel against its torch reference, and the codec's decoder.

GPU: `pytest -q tests/gpu` (the kernels' and the codec's GPU tests). On a GPU machine none of
them may skip for want of a GPU, so a run that passes nothing fails.
Dry run: the same kernels' host-emulated tests on the CPU instead."""

from collections.abc import Iterator

from device_common import TESTS, Context, Skip, run_pytest

HOST_EMULATED = [  # the CPU equivalents of tests/gpu
    "tests/test_cuda_kernels_cpu.py",
    "tests/test_cuda_attention_cpu.py",
    "tests/test_codec_kernel_cpu.py",
    "tests/test_cuda_compile.py",
    "tests/test_cuda_engine_cpu.py",  # the engine on those kernels, emulated: its GPU path
    "tests/test_cuda_fp8_cpu.py",  # FP8 linears: the kernel, and an FP8 checkpoint's engine
]


def kernels(ctx: Context) -> Iterator[dict]:
    if ctx.gpu:
        record = run_pytest(["tests/gpu"], ctx, "kernels")
        ran = record.get("passed", 0) + record.get("failed", 0) + record.get("errors", 0)
        record["ok"] = record["rc"] == 0 and ran > 0
        if record["rc"] == 0 and ran == 0:
            record["why"] = "no GPU test ran (all skipped: cupy or the GPU missing?)"
    else:
        present = [p for p in HOST_EMULATED if (TESTS.parent / p).exists()]
        missing = [p for p in HOST_EMULATED if p not in present]
        if not present:
            raise Skip(f"none of the host-emulated kernel tests is there yet ({HOST_EMULATED})")
        record = run_pytest(present, ctx, "kernels")
        record["ok"] = record["rc"] == 0
        if missing:
            record["not_there_yet"] = missing
    record["summary"] = _counts(record)
    yield record


def _counts(record: dict) -> str:
    text = ", ".join(
        f"{record.get(k, 0)} {k}"
        for k in ("passed", "failed", "errors", "skipped")
        if record.get(k)
    )
    if record.get("not_there_yet"):
        text += f" ({len(record['not_there_yet'])} test files not there yet)"
    if record["rc"] == -1:
        text += " (timed out)"
    return text or f"pytest rc {record['rc']}"
