"""`parser_for_template`: which tool-call format a model writes, from the markers its chat
template renders tools and tool calls with, else from its vocabulary's special tokens.

The template rules, first match wins (the order matters where a template shows several
markers: Qwen3-Coder's also shows `<tool_call>`, Hermes 3's also writes `"parameters": `):

    gpt_oss      <|channel|>                         harmony (gpt-oss)
    deepseek_v3  tool▁calls▁begin / tool▁call▁begin  DeepSeek-V3 / R1 / V3.1
    mistral      [TOOL_CALLS]                        Mistral, every tokenizer version
    qwen3_coder  <function=  and  <parameter=        Qwen3-Coder
    granite      <|tool_call|>                       Granite 3.x, Phi-4-mini
    hermes       <tool_call>                         Qwen2.5 / Qwen3 / Hermes / Granite 4
    pythonic     [func_name1(                        Llama 3.2 / 4 pythonic templates
    llama3_json  "parameters":  / <|python_tag|> / <|python_start|>   Llama 3.x / 4

A template that shows none (plain ChatML, or none at all) falls back to the vocabulary: the
first of <|channel|> + <|constrain|>, <｜tool▁calls▁begin｜>, [TOOL_CALLS], <|tool_call|>,
<|python_tag|>, <|python_start|> that is a token; else `hermes`.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

TEMPLATE_RULES: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("gpt_oss", lambda t: "<|channel|>" in t),
    ("deepseek_v3", lambda t: "tool▁calls▁begin" in t or "tool▁call▁begin" in t),
    ("mistral", lambda t: "[TOOL_CALLS]" in t),
    ("qwen3_coder", lambda t: "<function=" in t and "<parameter=" in t),
    ("granite", lambda t: "<|tool_call|>" in t),
    ("hermes", lambda t: "<tool_call>" in t),
    ("pythonic", lambda t: "[func_name1(" in t),
    ("llama3_json", lambda t: any(m in t for m in (
        '"parameters": ', "<|python_tag|>", "<|python_start|>"))),
)

VOCAB_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gpt_oss", ("<|channel|>", "<|constrain|>")),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("granite", ("<|tool_call|>",)),
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ("<|python_start|>",)),  # Llama 4
)

FALLBACK = "hermes"


def parser_for_template(template_source: str | None, vocab: Any = None) -> str:
    """The `TOOL_PARSERS` name for a model whose chat template is `template_source` and whose
    vocabulary is `vocab` (a set of token strings, or anything with `token_to_id`, such as
    `aserve.engine.tokenizer.Tokenizer`)."""
    if template_source:
        for name, shows in TEMPLATE_RULES:
            if shows(template_source):
                return name
    if vocab is not None:
        for name, tokens in VOCAB_RULES:
            if all(_has_token(vocab, token) for token in tokens):
                return name
    return FALLBACK


def _has_token(vocab: Any, token: str) -> bool:
    if hasattr(vocab, "token_to_id"):
        return vocab.token_to_id(token) is not None
    return isinstance(vocab, Container) and token in vocab
