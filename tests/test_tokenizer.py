"""Tokenizer: loading a model folder (and its variants and failures), encode/decode, BOS
handling, special ids and chat rendering, checked against transformers.AutoTokenizer."""

import json

import pytest
import transformers
from test_tokenizer_folders import (
    build_byte_fallback,
    copy_tokenizer_files,
    update_json,
)
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from shared.errors import InvalidRequestError, ModelFolderError
from shared.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space and  double  spaces\n\nnew lines\t tab",
    "Über naïve café — 東京 and ünïcödé ✓ 🙂🚀 👩‍👩‍👧",
    "def fibonacci(n):\n    return n",
    "special tokens in text: <s> and </s> and <|user|>",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "東京 is? 🙂"},
        {"role": "assistant", "content": "A city."},
        {"role": "user", "content": "And </s> this?"},
    ],
]


def hf_tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


def hf_chat_ids(hf, messages, **kwargs):
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out


def with_post_processor(folder, single: str):
    """Give tokenizer.json a TemplateProcessing post-processor, e.g. "<s> $A"."""
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    specials = [(t, backend.token_to_id(t)) for t in ("<s>", "</s>") if t in single]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    backend.save(str(folder / "tokenizer.json"))
    return folder


# --- folders on which transformers and Tison must agree id for id -------------------------


@pytest.fixture(
    params=["tiny_llama", "byte_fallback", "post_processor_bos", "special_tokens_fixed_up"]
)
def agreed_folder(request, tiny_llama, tmp_path):
    """Folders whose tokenizer.json and tokenizer_config.json agree on BOS (as published
    checkpoints do), so transformers 5 and Tison must give identical ids."""
    if request.param == "tiny_llama":
        return tiny_llama
    if request.param == "byte_fallback":
        return build_byte_fallback(tmp_path)
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    if request.param == "post_processor_bos":  # Llama 3 style: BOS from tokenizer.json only
        update_json(folder / "tokenizer_config.json", add_bos_token=None)
        return with_post_processor(folder, "<s> $A")
    # </s> not flagged special (and lstrip) in tokenizer.json, <pad> missing from the
    # vocabulary, eos given as an AddedToken dict: HF makes both special tokens.
    data = json.loads((folder / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        if token["content"] == "</s>":
            token.update(special=False, lstrip=True)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    eos = {"__type": "AddedToken", "content": "</s>", "lstrip": True, "special": True}
    update_json(folder / "tokenizer_config.json", pad_token="<pad>", eos_token=eos)
    return folder


def test_encode_decode_match_transformers(agreed_folder):
    tok, hf = Tokenizer.from_dir(agreed_folder), hf_tokenizer(agreed_folder)
    for text in TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.vocab_size == len(hf)
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.all_special_ids == frozenset(hf.all_special_ids)
    assert hf.eos_token_id in tok.eos_token_ids


def test_chat_matches_transformers(agreed_folder):
    tok, hf = Tokenizer.from_dir(agreed_folder), hf_tokenizer(agreed_folder)
    for messages in CONVERSATIONS:
        for gen_prompt in (True, False):
            text = tok.apply_chat_template(messages, add_generation_prompt=gen_prompt)
            expected = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen_prompt
            )
            assert text == expected
        assert tok.encode_chat(messages) == hf_chat_ids(hf, messages)


def test_byte_fallback_bos_comes_once(tmp_path):
    # add_bos_token and a "<s> $A" post-processor, and a template that writes bos_token too.
    tok = Tokenizer.from_dir(build_byte_fallback(tmp_path))
    assert tok.encode("Hello")[0] == tok.bos_token_id
    assert tok.encode("Hello").count(tok.bos_token_id) == 1
    ids = tok.encode_chat(CONVERSATIONS[0])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode("Hello", add_special_tokens=False)[0] != tok.bos_token_id


# --- add_bos_token / add_eos_token rules (transformers 5 ignores them: no HF comparison) ------


@pytest.mark.parametrize(
    "post_processor, flags, expected",
    [
        (None, {}, []),  # nothing asks for BOS
        (None, {"add_bos_token": True}, ["<s>"]),
        ("<s> $A", {}, ["<s>"]),
        ("<s> $A", {"add_bos_token": True}, ["<s>"]),  # once, not twice
        ("<s> $A", {"add_bos_token": False}, []),  # the config switches it off
        ("<s> $A", {"add_eos_token": True}, ["<s>", "</s>"]),  # absent flag keeps BOS
        (None, {"add_bos_token": True, "add_eos_token": True}, ["<s>", "</s>"]),
    ],
)
def test_bos_eos_flags(tiny_llama, tmp_path, post_processor, flags, expected):
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    update_json(folder / "tokenizer_config.json", **{"add_bos_token": None, **flags})
    if post_processor:
        with_post_processor(folder, post_processor)
    tok = Tokenizer.from_dir(folder)
    plain = tok.encode("Hello world", add_special_tokens=False)
    ids = tok.encode("Hello world")
    added = [tok.backend.id_to_token(i) for i in ids if i not in plain]
    assert added == expected
    assert [i for i in ids if i in plain] == plain


# --- loading: files, variants, failures -------------------------------------------------------


def test_loads_tiny_model_folder(tiny_llama):
    tok = Tokenizer.from_dir(tiny_llama)
    gen = json.loads((tiny_llama / "generation_config.json").read_text())
    assert tok.eos_token_ids == {tok.backend.token_to_id("</s>"), gen["eos_token_id"]}
    assert tok.bos_token_id == tok.backend.token_to_id("<s>")
    assert tok.model_max_length == 256
    assert tok.has_chat_template
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    # Chat role markers are special (skipped by decode) without being named special tokens.
    user = tok.backend.token_to_id("<|user|>")
    assert user in tok.special_token_ids and user not in tok.all_special_ids
    text = "Über naïve café — 東京 🙂"
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("eos, expected", [([2, 5], {2, 5}), (4, {2, 4}), (None, {2})])
def test_generation_config_eos_ids(tiny_llama, tmp_path, eos, expected):
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    update_json(folder / "generation_config.json", eos_token_id=eos)
    assert Tokenizer.from_dir(folder).eos_token_ids == expected


def test_without_optional_files(tiny_llama, tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((tiny_llama / "tokenizer.json").read_text())
    tok = Tokenizer.from_dir(folder)
    assert tok.bos_token_id is None and tok.eos_token_ids == frozenset()
    assert tok.model_max_length is None and not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])
    assert tok.decode(tok.encode("plain text")) == "plain text"


def test_chat_template_jinja_file_wins(tiny_llama, tmp_path):
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    tok, hf = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    text = tok.apply_chat_template(CONVERSATIONS[1])
    assert text.startswith("system: Be brief.\nuser: ")
    assert text == hf.apply_chat_template(CONVERSATIONS[1], tokenize=False)


def test_named_chat_templates(tiny_llama, tmp_path):
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    templates = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    update_json(folder / "tokenizer_config.json", chat_template=templates)
    tok = Tokenizer.from_dir(folder)
    assert tok.apply_chat_template(CONVERSATIONS[1]) == "D4"
    assert tok.apply_chat_template(CONVERSATIONS[1], tools=[{"name": "f"}]) == "T1"


def test_tokenizer_json_truncation_is_ignored(tiny_llama, tmp_path):
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.enable_truncation(max_length=4)
    backend.save(str(folder / "tokenizer.json"))
    assert len(Tokenizer.from_dir(folder).encode("Once upon a time there was a model")) > 4


@pytest.mark.parametrize(
    "name, content",
    [
        ("tokenizer.json", None),
        ("tokenizer.json", '{"model": '),
        ("tokenizer.json", '{"version": "1.0", "model": {"type": "Nope"}}'),
        ("tokenizer_config.json", "{not json"),
        ("tokenizer_config.json", "[1, 2]"),
        ("tokenizer_config.json", '{"bos_token": 7}'),
        ("tokenizer_config.json", '{"chat_template": "{% for m in messages %}"}'),
        ("tokenizer_config.json", '{"chat_template": 3}'),
        ("generation_config.json", '{"eos_token_id": "x"}'),
        ("generation_config.json", "\xff\xfe"),
        ("chat_template.jinja", "{{ messages[0] }"),
    ],
)
def test_bad_files_raise_model_folder_error(tiny_llama, tmp_path, name, content):
    folder = copy_tokenizer_files(tiny_llama, tmp_path)
    if content is None:
        (folder / name).unlink()
    else:
        (folder / name).write_text(content, encoding="latin-1")
    with pytest.raises(ModelFolderError) as info:
        Tokenizer.from_dir(folder)
    assert info.value.path == str(folder / name)
    assert name in str(info.value)


def test_a_long_text_encodes_as_a_short_one_would(tmp_path):
    """Texts past LONG_TEXT_CHARS go through encode_batch (the GIL released): the same ids."""
    from shared.default_model import default_model_dir
    from shared.tokenizer.tokenizer import LONG_TEXT_CHARS, Tokenizer

    tok = Tokenizer.from_dir(default_model_dir())
    text = "def fibonacci(n): über 東京 🙂\n" * (LONG_TEXT_CHARS // 10)
    assert len(text) > LONG_TEXT_CHARS
    assert tok.encode(text) == tok.backend.encode(text).ids
