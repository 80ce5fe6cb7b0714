"""The decode-step byte count of loadtest/roofline.py, checked on a model transformers builds:
its linear and norm parameters plus the LM head (the embedding table read one row a token),
and the KV each sequence's context adds; the engine table's shares of that roofline; the read
probe (membw.c) the benches divide by; and a bench run restarted at a lower tier."""

import functools
import operator
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from loadtest.bench_engine import print_table, read_probes
from loadtest.random_model import llama4_fields, llama_fields
from loadtest.roofline import LlamaShape, decode_step_bytes, mean_step_bytes


@pytest.mark.parametrize("tied", [False, True])
def test_weights_counted_are_the_models_minus_the_embedding_table(tied):
    fields = llama_fields(1000, 64, 160, layers=3, heads=4, kv_heads=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    params = {n: p.numel() for n, p in model.named_parameters()}  # tied: the table once
    # untied: the table is not read, the LM head is; tied: the one table is read as the head
    read = sum(params.values()) - (0 if tied else params["model.embed_tokens.weight"])
    shape = LlamaShape.from_fields(fields)
    one_token = decode_step_bytes(shape, [1], weight_bytes=2)
    kv_one = 3 * 2 * 2 * 16  # layers x (K, V) x kv heads x head_dim, one key
    assert one_token == (read + 64 + kv_one) * 2 + 1000 * 4  # + one embedding row, logits


def test_kv_and_batch_terms():
    shape = LlamaShape.from_fields(llama_fields(1000, 64, 160, layers=3, heads=4, kv_heads=2))
    base = decode_step_bytes(shape, [10])
    per_key = 3 * 2 * 2 * 16 * 2  # bytes of K and V of one position, all layers
    assert decode_step_bytes(shape, [11]) - base == per_key
    assert decode_step_bytes(shape, [10, 10]) - base == 10 * per_key + 64 * 2 + 1000 * 4
    # decode steps after a 5-token prompt with 3 new tokens attend 6 and 7 keys
    expected = (decode_step_bytes(shape, [6]) + decode_step_bytes(shape, [7])) / 2
    assert mean_step_bytes(shape, 1, 5, 3) == expected


def test_a_mixture_of_experts_reads_its_active_experts_only():
    fields = llama_fields(1000, 64, 160, layers=3, heads=4, kv_heads=2)
    dense = LlamaShape.from_fields(fields)
    moe = LlamaShape.from_fields(dict(fields, num_local_experts=8, num_experts_per_tok=2))
    expert = 3 * 64 * 160  # gate, up, down of one expert
    router = 64 * 8
    # batch 1: two experts a layer, where the dense model has one MLP of the same size
    assert decode_step_bytes(moe, [5]) - decode_step_bytes(dense, [5]) == 3 * (expert + router) * 2
    # a large batch reads every expert; two tokens, 1 - (3/4)^2 of them in expectation
    assert moe.active_experts(1000) == pytest.approx(8)
    assert moe.active_experts(2) == pytest.approx(8 * (1 - 0.75**2))


def test_llama4_reads_one_expert_and_the_shared_one():
    """The bench's Scout-shaped model, built by transformers: a batch-1 step reads the
    attention, norms, router, one routed expert and the shared expert of every layer."""
    fields = llama4_fields(4, 8, vocab=1000, hidden=64, intermediate=96, layers=2, heads=4,
                           kv_heads=2)  # fmt: skip
    config = transformers.AutoConfig.for_model(**fields)
    model = transformers.AutoModelForCausalLM.from_config(config)
    params = {n: p.numel() for n, p in model.named_parameters()}
    experts = sum(v for n, v in params.items() if ".experts." in n)  # all 4 of each layer
    read = sum(params.values()) - params["model.embed_tokens.weight"] - experts * 3 // 4
    shape = LlamaShape.from_fields(fields)
    kv_one = 2 * 2 * 2 * 16  # layers x (K, V) x kv heads x head_dim, one key
    assert decode_step_bytes(shape, [1]) == (read + 64 + kv_one) * 2 + 1000 * 4


def test_the_engine_table_gives_the_share_and_what_tison_read(capsys):
    fields = llama_fields(1000, 64, 160, layers=3, heads=4, kv_heads=2)
    shape = LlamaShape.from_fields(fields)
    step = mean_step_bytes(shape, 1, 8, 4, 2)
    tok_s = 20e9 / step  # Tison read 20 GB/s in both rounds
    rounds = [  # (Tison, transformers, the probe's GB/s around the measure)
        {"batch-1 decode tok/s": (tok_s, tok_s / 2, 40.0)},
        {"batch-1 decode tok/s": (tok_s, tok_s / 4, 25.0)},
    ]
    print_table(rounds, shape, 8, 4, 16)
    row = capsys.readouterr().out.splitlines()[-1]
    # shares 50% and 80%: their median; the ratio's median and range
    assert "| 65%: 20 GB/s of 25-40 |" in row and "3.00x (2.00-4.00)" in row


def test_a_bench_run_at_a_tier_restarts_as_the_same_command(tmp_path):
    """run_at_tier restarts the very command that called it (bench_step_overhead calls it too:
    it used to restart as bench_engine), with TISON_CPU_ISA set, once."""
    script = tmp_path / "bench.py"
    script.write_text(
        "import os, sys\n"
        "from loadtest.bench_engine import run_at_tier\n"
        "print('start', os.environ.get('TISON_CPU_ISA'), sys.argv[1:], flush=True)\n"
        "run_at_tier('portable')\n"
        "print('ran', os.environ['TISON_CPU_ISA'], sys.argv[1:])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TISON_CPU_ISA"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, str(script), "--batch", "32"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out == [
        "start None ['--batch', '32']",
        "start portable ['--batch', '32']",
        "ran portable ['--batch', '32']",
    ]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("streams", [1, 2, 4, 8])
def test_the_read_probe_reads_every_word_once(threads, streams):
    """membw.c's read_xor, as memory_bandwidth_gbs runs it with one stream a thread and four,
    XORs every word of the buffer once, whatever the split: shares and streams of uneven lines
    (a line is 8 words), and words after the last whole line. No word is 0 and equal ones lie
    126 apart, so a word read twice or skipped, or a run of them, changes the XOR."""
    words = 1 << torch.arange(8 * 3 * 5 * 7 + 5, dtype=torch.int64) % 63
    words[::2] |= 1 << 63  # words past bit 62 too: every bit of a lane in use
    expected = functools.reduce(operator.xor, words.tolist())
    probe = read_probes().read_xor
    assert probe(words.data_ptr(), words.numel(), threads, streams) & (2**64 - 1) == (
        expected & (2**64 - 1)
    )
