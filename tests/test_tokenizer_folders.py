"""Tokenizer folders for the test_tokenizer* files (this module holds no tests): the byte-level
BPE of tiny_models, a SentencePiece-style byte-fallback BPE as Llama 2 / Mistral ship it, and
variants of their config files."""

import json
import shutil
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from tiny_models import CORPUS, build_tokenizer

SP_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
SP_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def build_byte_level(out: Path, **config_changes) -> Path:
    """tiny_models' byte-level tokenizer, tokenizer_config.json updated with `config_changes`
    (a None value deletes the key)."""
    build_tokenizer(out)
    return update_json(out / "tokenizer_config.json", **config_changes).parent


def build_byte_fallback(out: Path, **config_changes) -> Path:
    """A byte-fallback BPE trained on the tiny corpus with a 60-character alphabet, so most
    CJK, emoji and accented characters are spelled with <0xNN> tokens: Metaspace pre-tokenizer
    (prefix space on the first word only), the Replace + ByteFallback + Fuse + Strip decoder, and
    a "<s> $A" post-processor. This is the pipeline transformers' LlamaTokenizer builds, so
    AutoTokenizer runs the same one."""
    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trained.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SP_SPECIAL_TOKENS, limit_alphabet=60, show_progress=False
    )
    trained.train_from_iterator(CORPUS, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SP_SPECIAL_TOKENS]
    )
    # As Llama 2 ships it: BOS both from the post-processor and from add_bos_token.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "legacy": False,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": SP_CHAT_TEMPLATE,
        "model_max_length": 1000000000000000019884624838656,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return update_json(out / "tokenizer_config.json", **config_changes).parent


def copy_tokenizer_files(src: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def update_json(path: Path, **changes) -> Path:
    data = json.loads(path.read_text()) if path.is_file() else {}
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return path


def byte_token_ids(tokenizer, data: bytes) -> list[int]:
    """One token per byte of `data`: <0xNN> tokens in a byte-fallback vocabulary, the
    byte-level alphabet's characters in a byte-level one."""
    byte_fallback = tokenizer.backend.token_to_id("<0x41>") is not None
    tokens = [f"<0x{b:02X}>" if byte_fallback else _BYTE_LEVEL_CHARS[b] for b in data]
    return [tokenizer.backend.token_to_id(t) for t in tokens]


def _byte_level_chars() -> list[str]:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 onwards.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_LEVEL_CHARS = _byte_level_chars()
