"""Reading a model folder's tokenizer files: tokenizer.json, tokenizer_config.json,
generation_config.json and the chat templates. A failure is a ModelFolderError naming its file."""

import json
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from shared.errors import ModelFolderError
from shared.tokenizer.chat import ChatTemplate

TOKENIZER_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_FILE = "generation_config.json"
TEMPLATE_FILE = "chat_template.jinja"
EXTRA_TEMPLATES_DIR = "additional_chat_templates"  # transformers 5 saves named templates here
# The named special tokens of HF tokenizers (SPECIAL_TOKENS_ATTRIBUTES), in HF's order.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_NO_LENGTH_LIMIT = 1e29  # HF writes int(1e30) as model_max_length when there is no limit


def load_backend(model_dir: Path) -> BackendTokenizer:
    """tokenizer.json as a `tokenizers.Tokenizer`, with any truncation or padding it carries
    switched off: an inference engine rejects long prompts, it never cuts them silently."""
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        tiktoken = model_dir / TIKTOKEN_FILE
        if tiktoken.is_file():  # Kimi K2's folders: a tiktoken BPE read by the model's own code
            raise ModelFolderError(
                str(path),
                f"missing; the folder has {tiktoken}, a tiktoken tokenizer, which Tison does not "
                "read: save it as tokenizer.json (transformers: AutoTokenizer.from_pretrained("
                "folder, trust_remote_code=True).save_pretrained(folder))",
            )
        raise ModelFolderError(str(path), "missing")
    try:
        backend = BackendTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for every parse error
        raise ModelFolderError(str(path), f"cannot be loaded: {e}") from e
    backend.no_truncation()
    backend.no_padding()
    return backend


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None when the (optional) file is absent."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(str(path), f"corrupt: {e}") from e
    if not isinstance(data, dict):
        raise ModelFolderError(str(path), "expected a JSON object")
    return data


def as_added_token(value: Any, key: str, path: Path) -> AddedToken:
    """A special token given as a string or as an AddedToken dict `{"content": ...}`."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"],
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", False)),
            special=True,
        )
    raise ModelFolderError(str(path), f"{key} must be a string or {{'content': ...}}")


def special_tokens(config: dict[str, Any], path: Path) -> tuple[dict, list[AddedToken]]:
    """(named special tokens {name: AddedToken}, extra special tokens) of tokenizer_config.json.
    A dict of extra tokens (transformers 5) names model-specific tokens, e.g. image_token."""
    named = {k: as_added_token(config[k], k, path) for k in NAMED_SPECIAL_TOKENS if config.get(k)}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, dict):
        named |= {k: as_added_token(v, k, path) for k, v in extra.items()}
        return named, []
    if not isinstance(extra, list):
        raise ModelFolderError(str(path), "extra_special_tokens must be a list or an object")
    return named, [as_added_token(v, "extra_special_tokens", path) for v in extra]


def generation_eos_ids(model_dir: Path) -> frozenset[int]:
    """generation_config.json's eos_token_id (an int or a list of ints), if any."""
    path = model_dir / GENERATION_FILE
    value = (read_json(path) or {}).get("eos_token_id")
    if value is None:
        return frozenset()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelFolderError(str(path), "eos_token_id must be an int or a list of ints")
    return frozenset(ids)


def model_max_length(config: dict[str, Any]) -> int | None:
    value = config.get("model_max_length")
    if not isinstance(value, (int, float)) or value >= _NO_LENGTH_LIMIT:
        return None
    return int(value)


def chat_templates(model_dir: Path, config: dict[str, Any]) -> dict[str, ChatTemplate]:
    """Named chat templates; "default" is the main one. chat_template.jinja wins over
    tokenizer_config.json["chat_template"] (a string, or a list of {name, template})."""
    sources: dict[str, tuple[str, Path]] = {}
    config_path = model_dir / CONFIG_FILE
    value = config.get("chat_template")
    if isinstance(value, str):
        sources["default"] = (value, config_path)
    elif isinstance(value, list):
        for item in value:
            if not (isinstance(item, dict) and isinstance(item.get("template"), str)):
                raise ModelFolderError(str(config_path), "chat_template: bad {name, template}")
            sources[str(item.get("name"))] = (item["template"], config_path)
    elif value is not None:
        raise ModelFolderError(str(config_path), "chat_template must be a string or a list")
    for path in sorted((model_dir / EXTRA_TEMPLATES_DIR).glob("*.jinja")):
        sources[path.stem] = (_read_text(path), path)
    if (model_dir / TEMPLATE_FILE).is_file():
        sources["default"] = (_read_text(model_dir / TEMPLATE_FILE), model_dir / TEMPLATE_FILE)
    return {name: _compile(source, path) for name, (source, path) in sources.items()}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFolderError(str(path), f"unreadable: {e}") from e


def _compile(source: str, path: Path) -> ChatTemplate:
    try:
        return ChatTemplate(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFolderError(str(path), f"chat template syntax error: {e}") from e
