"""Train Tison's default model from scratch on the Python standard library's sources.

    python -m shared.default_model.train --out DIR [--minutes M] [--seed S]

A byte-level BPE tokenizer and a small LlamaForCausalLM, trained on one CPU thread
until the wall-clock budget or the step count runs out, whichever comes first; then
the held-out loss is measured and the folder (config, BF16 safetensors, tokenizer
files, training_report.json) is written to DIR.
"""

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from shared.default_model import corpus
from shared.default_model.tokenizer_files import EOS, train_tokenizer, write_tokenizer_files


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a training run; recorded in training_report.json."""

    seed: int = 0
    minutes: float = 45.0  # wall-clock budget of the training loop
    threads: int = 1  # torch threads (the machine may be shared)
    max_steps: int = 20_000
    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    seq_len: int = 512  # trained context; also max_position_embeddings
    batch_size: int = 8
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_tokens: int = 16_384  # periodic held-out evaluation
    final_eval_tokens: int = 131_072


def encode(tok: tokenizers.Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream: every file preceded by `<|endoftext|>`, as in inference (BOS)."""
    eos = tok.token_to_id(EOS)
    stream = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream.append(eos)
        stream.extend(enc.ids)
    return np.asarray(stream, dtype=np.int64)


def model_config(cfg: TrainConfig, eos_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq_len,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        architectures=["LlamaForCausalLM"],
    )


def lm_loss(model: LlamaForCausalLM, chunk: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of chunk (B, T+1), under BF16 autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=chunk[:, :-1]).logits  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, data: np.ndarray, seq_len: int, max_tokens: int):
    """Mean loss over consecutive non-overlapping windows from the start of `data`."""
    model.eval()
    n = min(max_tokens, len(data) - 1) // seq_len
    windows = [data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    total = 0.0
    for start in range(0, n, 16):
        chunk = torch.from_numpy(np.stack(windows[start : start + 16]))  # (b, T+1)
        total += lm_loss(model, chunk).item() * len(chunk)
    model.train()
    return total / n


def learning_rate(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup by steps, then cosine decay by progress (time or steps, the larger)."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.peak_lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: LlamaForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(0.9, 0.95), fused=False)


def train_loop(model, cfg: TrainConfig, train: np.ndarray, held: np.ndarray, log) -> dict:
    """Run AdamW steps until the budget or max_steps; returns the loop's statistics."""
    rng = np.random.default_rng(cfg.seed)
    optimizer = make_optimizer(model, cfg)
    budget_s = cfg.minutes * 60.0
    start = time.monotonic()
    step, train_loss, ema = 0, float("nan"), None
    while step < cfg.max_steps and time.monotonic() - start < budget_s:
        progress = max(step / cfg.max_steps, (time.monotonic() - start) / budget_s)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step, progress)
        offsets = rng.integers(0, len(train) - cfg.seq_len - 1, cfg.batch_size)
        batch = torch.from_numpy(np.stack([train[o : o + cfg.seq_len + 1] for o in offsets]))
        loss = lm_loss(model, batch)  # batch: (B, T+1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        train_loss = ema
        if step % cfg.eval_every == 0:
            held_loss = held_out_loss(model, held, cfg.seq_len, cfg.eval_tokens)
            elapsed = time.monotonic() - start
            tok_s = step * cfg.batch_size * cfg.seq_len / elapsed
            log(
                f"step {step} train {train_loss:.3f} held-out {held_loss:.3f} "
                f"lr {optimizer.param_groups[0]['lr']:.2e} {tok_s:.0f} tok/s {elapsed:.0f}s"
            )
    elapsed = time.monotonic() - start
    return {
        "steps": step,
        "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "train_loss": train_loss,
        "train_seconds": round(elapsed, 1),
    }


def save(model: LlamaForCausalLM, tok, cfg: TrainConfig, out: Path, report: dict) -> None:
    """Write the model folder: BF16 safetensors, config, tokenizer files, the report."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    write_tokenizer_files(tok, out, cfg.seq_len)
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


def run(cfg: TrainConfig, out: Path, log=print) -> dict:
    """Tokenizer, data, model, training, final held-out evaluation, saved folder."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    wall_start = time.monotonic()
    train_texts, held_texts = corpus.split(corpus.source_files())
    tok = train_tokenizer(train_texts, cfg.vocab_size)
    train, held = encode(tok, train_texts), encode(tok, held_texts)
    log(
        f"{len(train_texts)} train files ({len(train)} tokens), "
        f"{len(held_texts)} held-out files ({len(held)} tokens)"
    )
    model = LlamaForCausalLM(model_config(cfg, tok.token_to_id(EOS)))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{n_params} parameters")
    stats = train_loop(model, cfg, train, held, log)
    held_loss = held_out_loss(model, held, cfg.seq_len, cfg.final_eval_tokens)
    log(f"final held-out loss {held_loss:.4f} nats/token")
    report = {
        **stats,
        "held_out_loss": round(held_loss, 4),
        "held_out_tokens": min(cfg.final_eval_tokens, len(held) - 1) // cfg.seq_len * cfg.seq_len,
        "train_files": len(train_texts),
        "held_out_files": len(held_texts),
        "train_corpus_tokens": int(len(train)),
        "parameters": n_params,
        "wall_seconds": round(time.monotonic() - wall_start, 1),
        "config": asdict(cfg),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    save(model, tok, cfg, out, report)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    parser.add_argument("--minutes", type=float, default=TrainConfig.minutes)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--max-steps", type=int, default=TrainConfig.max_steps)
    parser.add_argument("--threads", type=int, default=TrainConfig.threads)
    args = parser.parse_args(argv)
    cfg = TrainConfig(
        seed=args.seed, minutes=args.minutes, max_steps=args.max_steps, threads=args.threads
    )
    run(cfg, args.out, log=lambda msg: print(msg, flush=True))


if __name__ == "__main__":
    main()
