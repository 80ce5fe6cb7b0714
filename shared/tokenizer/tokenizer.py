"""The model's tokenizer: tokenizer.json run by `tokenizers`, with Hugging Face's semantics for
special tokens, BOS/EOS insertion and chat templates."""

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from shared.errors import InvalidRequestError
from shared.tokenizer import loading
from shared.tokenizer.chat import ChatTemplate

LONG_TEXT_CHARS = 16_384  # longer texts are encoded with the GIL released (encode)


class Tokenizer:
    """Text <-> token ids, special token ids and chat rendering for one model.

    Build it with `Tokenizer.from_dir(model_dir)`; the constructor takes a backend already
    prepared (special tokens added, post-processor set) as `from_dir` leaves it.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: Mapping[str, str],
        extra_special_tokens: Sequence[str] = (),
        generation_eos_ids: Iterable[int] = (),
        chat_templates: Mapping[str, ChatTemplate] | None = None,
        model_max_length: int | None = None,
    ):
        self.backend = backend  # the `tokenizers.Tokenizer`, for token <-> id lookups
        self.special_tokens = dict(special_tokens)  # {"bos_token": "<s>", ...}, as HF names them
        self.model_max_length = model_max_length  # None: the folder sets no limit
        self.chat_templates = dict(chat_templates or {})
        self.bos_token_id = self._id_of("bos_token")
        eos_id = self._id_of("eos_token")
        self.eos_token_ids = frozenset(generation_eos_ids) | ({eos_id} - {None})
        # HF's all_special_ids: the named special tokens and the extra ones.
        named = [*self.special_tokens.values(), *extra_special_tokens]
        self.all_special_ids = frozenset(self._ids_of(named))
        added = backend.get_added_tokens_decoder()
        # What decode(skip_special_tokens=True) drops: every added token flagged special, which
        # includes e.g. chat role markers that all_special_ids (HF's named + extra) leaves out.
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load tokenizer.json (required), tokenizer_config.json, generation_config.json and
        chat_template.jinja from a model folder. Raises ModelFolderError naming a bad file."""
        model_dir = Path(model_dir)
        backend = loading.load_backend(model_dir)
        config_path = model_dir / loading.CONFIG_FILE
        config = loading.read_json(config_path) or {}
        named, extra = loading.special_tokens(config, config_path)
        _add_special_tokens(backend, [*named.values(), *extra])
        bos, eos = named.get("bos_token"), named.get("eos_token")
        _set_post_processor(backend, config, bos and bos.content, eos and eos.content)
        return cls(
            backend,
            special_tokens={k: t.content for k, t in named.items()},
            extra_special_tokens=[t.content for t in extra],
            generation_eos_ids=loading.generation_eos_ids(model_dir),
            chat_templates=loading.chat_templates(model_dir, config),
            model_max_length=loading.model_max_length(config),
        )

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens (HF's len(tokenizer))."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return "default" in self.chat_templates

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS/EOS as the post-processor adds them.
        A long text goes through encode_batch, which releases the GIL while it works (encode
        holds it: 1.3 s for a 1 MB text, every other thread of the process stalled, the
        gateway's event loop included, measured); short ones skip its thread hand-off."""
        if len(text) > LONG_TEXT_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the model's chat template (its "tool_use" template when
        tools are given and it has one). Raises InvalidRequestError("messages", ...)."""
        template = self._chat_template(tools)
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation. Like HF, the text is encoded without adding
        special tokens: the template writes BOS itself when the model wants one."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _chat_template(self, tools: list[dict] | None) -> ChatTemplate:
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" not in self.chat_templates:
            raise InvalidRequestError("messages", "this model has no chat template")
        return self.chat_templates["default"]

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def _ids_of(self, tokens: Iterable[str]) -> list[int]:
        ids = (self.backend.token_to_id(t) for t in tokens)
        return [i for i in ids if i is not None]


def _add_special_tokens(backend: BackendTokenizer, tokens: Sequence[AddedToken]) -> None:
    """Make every configured special token an added token flagged special, as HF does: missing
    ones are added; existing ones keep their lstrip/rstrip/... flags and become special."""
    existing = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    to_add = []
    for token in tokens:
        known = existing.get(token.content)
        if known is None:
            to_add.append(token)
        elif not known.special:
            to_add.append(_as_special(known))
    if to_add:
        backend.add_special_tokens(to_add)


def _as_special(token: AddedToken) -> AddedToken:
    return AddedToken(
        token.content,
        single_word=token.single_word,
        lstrip=token.lstrip,
        rstrip=token.rstrip,
        normalized=token.normalized,
        special=True,
    )


def _set_post_processor(
    backend: BackendTokenizer, config: Mapping[str, Any], bos: str | None, eos: str | None
) -> None:
    """add_bos_token / add_eos_token in tokenizer_config.json, when present, decide: the
    post-processor becomes "[BOS] $A [EOS]" per the flags, as transformers 4's Llama and Gemma
    tokenizers rebuild it (an absent flag keeps what tokenizer.json's post-processor does).
    Otherwise tokenizer.json's post-processor alone decides. Either way BOS comes once at most.
    (transformers 5 ignores the flags when tokenizer.json exists; the two rules agree whenever
    the two files agree, as they do in published checkpoints.)"""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    around = backend.encode("").ids  # what the current post-processor adds around a text
    has_bos = bos is not None and around[:1] == [backend.token_to_id(bos)]
    has_eos = eos is not None and around[int(has_bos) :][-1:] == [backend.token_to_id(eos)]
    add_bos = bos is not None and bool(config.get("add_bos_token", has_bos))
    add_eos = eos is not None and bool(config.get("add_eos_token", has_eos))
    head = [bos] if add_bos else []
    tail = [eos] if add_eos else []
    specials = {t: backend.token_to_id(t) for t in head + tail}
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*head, "$A", *tail]), special_tokens=list(specials.items())
    )
