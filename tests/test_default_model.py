"""The packaged default model: loads with transformers, its held-out loss on stdlib files
it never saw is below the stated bound, it writes Python, and Tison's engine agrees."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import shared.default_model as default_model
from shared.default_model import corpus
from shared.default_model.train import encode
from shared.engine.llm import LLM
from shared.errors import ModelFolderError
from shared.sampling.params import SamplingParams

from services_harness import REPO_ROOT

PROMPT = "def fibonacci(n):"
MAX_FOLDER_BYTES = 25 * 1024 * 1024
LOSS_MARGIN = 0.5  # nats/token over the training report's held-out loss
HELD_OUT_BOUND = 4.2  # nats/token: the stated bound, whatever the report says (3.72 reported)
# 16 windows of 256 tokens spread evenly over the held-out stream (ordinary stdlib modules;
# the generated codec tables of encodings/ are left out of the corpus).
EVAL_WINDOWS, EVAL_LEN = 16, 256


@pytest.fixture(scope="module")
def model_dir():
    return default_model.default_model_dir()


@pytest.fixture(scope="module")
def report(model_dir):
    return json.loads((model_dir / "training_report.json").read_text())


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(model_dir, hf_model):
    """transformers' greedy continuation of PROMPT: (new token ids, decoded text)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = hf_model.generate(ids, max_new_tokens=32, do_sample=False)
    new_ids = out[0, ids.shape[1] :].tolist()
    return new_ids, tok.decode(out[0], skip_special_tokens=True)


def test_folder_is_small_bf16_llama(model_dir):
    size = sum(p.stat().st_size for p in model_dir.iterdir())
    assert size <= MAX_FOLDER_BYTES
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    generation = json.loads((model_dir / "generation_config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert generation["eos_token_id"] == tok.token_to_id("<|endoftext|>") == config["eos_token_id"]


def test_tokenizer_and_chat_template(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.bos_token == tok.eos_token == "<|endoftext|>"
    assert tok(PROMPT).input_ids[0] == tok.bos_token_id
    assert tok.decode(tok(PROMPT).input_ids, skip_special_tokens=True) == PROMPT
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|endoftext|><|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[-2] == tok.convert_tokens_to_ids("<|assistant|>")


def test_held_out_loss_below_bound(model_dir, report, hf_model):
    held = [text for rel, text in corpus.source_files() if corpus.is_held_out(rel)]
    assert held, "no held-out stdlib files found"
    stream = encode(Tokenizer.from_file(str(model_dir / "tokenizer.json")), held)
    starts = np.linspace(0, len(stream) - EVAL_LEN - 1, EVAL_WINDOWS).astype(np.int64)
    windows = [stream[s : s + EVAL_LEN + 1] for s in starts]
    chunk = torch.from_numpy(np.stack(windows))  # (EVAL_WINDOWS, EVAL_LEN + 1)
    with torch.no_grad():
        logits = hf_model(input_ids=chunk[:, :-1]).logits  # (EVAL_WINDOWS, EVAL_LEN, V)
    loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()).item()
    assert loss < min(report["held_out_loss"] + LOSS_MARGIN, HELD_OUT_BOUND)


def test_greedy_fibonacci_looks_like_python(hf_greedy):
    _, text = hf_greedy
    body = text[len(PROMPT) :]
    assert text.startswith(PROMPT)
    assert "\n    " in body or "return" in body, body


def test_default_model_dir_missing_raises(monkeypatch):
    monkeypatch.setattr(default_model, "MODEL_NAME", "no-such-model")
    with pytest.raises(ModelFolderError, match="default model file missing"):
        default_model.default_model_dir()


def test_engine_greedy_matches_transformers(model_dir, hf_greedy):
    llm = LLM(str(model_dir), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=32)
    out = llm.generate([PROMPT], params)[0]
    assert list(out.token_ids) == hf_greedy[0]


def test_tison_generate_on_its_defaults_prints_the_engines_text(model_dir):
    """The README's `tison generate`: the bundled model in its dtype (bf16) at this run's CPU
    tier prints what the engine generates for the same prompt."""
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--max-tokens", "16", PROMPT],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = LLM(str(model_dir)).generate([PROMPT], SamplingParams(temperature=0, max_tokens=16))
    text = out[0].text
    assert text.strip() and result.stdout == text + ("" if text.endswith("\n") else "\n")
