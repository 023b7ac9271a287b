"""`Tokenizer`: a HF model directory's tokenizer, without transformers.

It loads `tokenizer.json` with the `tokenizers` library and applies what `tokenizer_config.json`
(plus `special_tokens_map.json`, `chat_template.jinja` and `generation_config.json`) says the way
transformers' `PreTrainedTokenizerFast` does, so that `encode`, `decode` and
`apply_chat_template(..., tokenize=False)` give what `AutoTokenizer` gives. Chat templates are
rendered by `chat_template.render`: jinja2's immutable sandbox, bounded, with the globals and
filters HF templates expect.

It is not a port of transformers' model-specific tokenizer classes (those that rebuild the
tokenizer from a vocab file): a directory is trusted to ship a complete `tokenizer.json`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from aserve.engine.chat_template import render as render_template

SPECIAL_TOKEN_ATTRS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GIL_FREE_ENCODE_CHARS = 20_000  # longer texts are encoded with the GIL released
_UNBOUNDED_LENGTH = int(1e29)  # transformers writes int(1e30) for "no limit"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """Text ↔ token ids, and chat messages → prompt text, for one model."""

    def __init__(self, backend: BackendTokenizer, config: Mapping[str, Any] | None = None,
                 generation_config: Mapping[str, Any] | None = None,
                 name_or_path: str = "") -> None:
        config = dict(config or {})
        self.backend = backend
        self.name_or_path = name_or_path
        self.special_tokens_map: dict[str, str] = {
            attr: content for attr in SPECIAL_TOKEN_ATTRS
            if (content := _content(config.get(attr))) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else extra  # {name: token} in v5
        self.extra_special_tokens = [c for t in extra if (c := _content(t)) is not None]
        self.chat_template: str | dict[str, str] | None = _named_templates(
            config.get("chat_template"))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        max_len = config.get("model_max_length")
        self.model_max_length: int | None = (
            int(max_len) if isinstance(max_len, (int, float)) and max_len < _UNBOUNDED_LENGTH
            else None)
        self._configure_backend(config)
        self.eos_token_ids = self._merge_eos_ids(generation_config or {})

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer a HF model directory ships."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"No tokenizer.json in {str(root)!r}: aserve needs a `tokenizers` serialization "
                "of the tokenizer (save it with a fast tokenizer's save_pretrained).")
        config = _read_json(root / "tokenizer_config.json") or {}
        special_map = _read_json(root / "special_tokens_map.json")
        if special_map and "added_tokens_decoder" not in config:
            config.update(special_map)  # transformers reads this legacy file only in that case
        templates = _read_template_files(root)
        if templates:
            config["chat_template"] = templates
        return cls(BackendTokenizer.from_file(str(tokenizer_file)), config,
                   _read_json(root / "generation_config.json"), name_or_path=str(root))

    # ----------------------------------------------------------------------------- text ↔ ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`. A long text goes through `encode_batch_fast`, which releases the
        GIL while it works (`encode` holds it throughout, freezing every other thread; see
        docs/benchmarks/before-after.md, "What the guards answer") and skips the offsets nobody
        reads here: the same ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}.")
        if len(text) > GIL_FREE_ENCODE_CHARS:
            encode_batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its longest entry, added
        tokens included (a byte-level or metaspace entry has a character per byte or character
        it covers, a byte-fallback one more). A text longer than this times a context length
        cannot fit in it, unless a normalizer deletes characters."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            # Like transformers: the clean-up is meant for WordPiece and would corrupt BPE text.
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ----------------------------------------------------------------------------- special ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _special_id(self, attr: str) -> int | None:
        content = self.special_tokens_map.get(attr)
        return None if content is None else self.backend.token_to_id(content)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @cached_property
    def skippable_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops: the added tokens marked
        special (a superset of `all_special_ids`)."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    @cached_property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of the `<0xNN>` byte tokens when the decoder has a ByteFallback step, else empty.
        That step decodes a run of byte tokens as a whole (one U+FFFD per byte if the run is not
        valid UTF-8), so incremental decoding must not commit to a run's text before it ends."""
        if "ByteFallback" not in repr(self.backend.decoder):
            return frozenset()
        vocab = self.backend.get_vocab(with_added_tokens=False)
        return frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named special tokens and the extra ones, in transformers' order."""
        contents = dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens])
        ids = (self.backend.token_to_id(c) for c in contents)
        return [i for i in ids if i is not None]

    # ----------------------------------------------------------------------------- chat

    def get_chat_template(self, chat_template: str | None = None,
                          tools: list[dict] | None = None) -> str:
        """The template to render: `chat_template` (a template or a template's name) if given,
        else the model's ("tool_use" when there are tools and the model names one, else
        "default")."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(f"Model {self.name_or_path!r} has several chat templates and none "
                             f"named 'default'; pick one of {sorted(own)} with chat_template.")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError(f"Model {self.name_or_path!r} has no chat template; pass one as "
                             "chat_template (a Jinja template string).")
        return own

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **kwargs: Any) -> str:
        """Render `messages` to prompt text, as transformers' `apply_chat_template(...,
        tokenize=False)` does, within `chat_template`'s bounds (`TemplateLimitError` past
        them). Extra keyword arguments become template variables."""
        template = self.get_chat_template(chat_template, tools)
        if not messages:
            raise ValueError("Cannot apply a chat template to an empty list of messages.")
        chat = [_normalize_message(m) for m in messages]
        variables = {**self.special_tokens_map, **kwargs}
        return render_template(template, messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)

    # ----------------------------------------------------------------------------- loading

    def _configure_backend(self, config: dict[str, Any]) -> None:
        """Bring the backend to the state transformers leaves it in after loading.

        The post-processor is left as tokenizer.json has it: transformers (v5) drops the config's
        add_bos_token / add_eos_token whenever a tokenizer.json exists, so those flags never
        change which ids `encode` adds.
        """
        backend = self.backend
        backend.no_padding()
        backend.no_truncation()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        declared = sorted((config.get("added_tokens_decoder") or {}).items(),
                          key=lambda kv: int(kv[0]))
        tokens = [AddedToken(**{k: v for k, v in t.items() if k != "__type"}) for _, t in declared]
        if tokens:  # like transformers: re-add them all, which also updates their flags
            backend.add_tokens(tokens)
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        named = [*self.special_tokens_map.values(), *self.extra_special_tokens]
        missing = [c for c in dict.fromkeys(named) if c not in present]
        if missing:
            backend.add_special_tokens([AddedToken(c, special=True) for c in missing])

    def _merge_eos_ids(self, generation_config: Mapping[str, Any]) -> tuple[int, ...]:
        """The tokenizer's EOS id, then any others generation_config.json declares."""
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        extra = generation_config.get("eos_token_id")
        extra = [extra] if isinstance(extra, int) else list(extra or [])
        return tuple(dict.fromkeys(ids + [int(i) for i in extra]))


# --------------------------------------------------------------------------------- helpers


def _content(token: Any) -> str | None:
    """A special token as the config writes it (a string or an AddedToken dict) → its text."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _named_templates(value: Any) -> str | dict[str, str] | None:
    if isinstance(value, (list, tuple)):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in value}
    return value


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _read_template_files(root: Path) -> str | dict[str, str] | None:
    """`chat_template.jinja` and `additional_chat_templates/*.jinja`, which override the config."""
    templates = {}
    if (root / "chat_template.jinja").is_file():
        templates["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"]
    return templates or None


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None-valued keys (templates handle a missing key better than None) and copy the
    reasoning under the names templates read, as transformers does."""
    if not isinstance(message, Mapping):
        raise TypeError(f"Chat messages must be dicts, got {message!r}.")
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out
