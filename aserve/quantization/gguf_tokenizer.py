"""A GGUF file's tokenizer as a `tokenizers.Tokenizer` and its tokenizer_config.json.

GGUF keeps the vocabulary (`tokenizer.ggml.tokens`, `.token_type`, `.merges`), the special
token ids and the chat template, but not the normalizer / pre-tokenizer / decoder: those follow
from `tokenizer.ggml.model` and llama.cpp's pre-tokenizer name (`tokenizer.ggml.pre`), as the
HF tokenizer.json of the model the file was made from had them:

    gpt2   byte-level BPE with the file's merges; the split before it by `pre`:
           default / gpt-2 / gpt2 / olmo            GPT-2's regex (ByteLevel's own)
           smollm / starcoder / refact / ...        single digits, then GPT-2's regex
           llama-bpe / llama3 / llama-v3 / ...      Llama 3's regex (merges ignored for whole
                                                    words in the vocabulary, as Llama 3's BPE)
           qwen2 / deepseek-r1-qwen                 Qwen2's regex, after NFC
           tekken                                   Mistral Nemo's regex

    llama  SentencePiece as HF's Llama / Mistral tokenizers run it: BPE with byte fallback
           (`<0x0A>` tokens), merges recovered from the scores (a merge of two pieces whose
           join is a token ranks by that token's score), spaces as "▁" with one in front of
           the text when `tokenizer.ggml.add_space_prefix` (default) says so

Token types: 3 (control) become special added tokens, 4 (user-defined, e.g. `<think>`) plain
added tokens; a BOS is added in front when `tokenizer.ggml.add_bos_token` says so (SentencePiece:
by default). Other tokenizer models and pre-tokenizers are refused by name.
"""

from __future__ import annotations

from typing import Any

CONTROL, USER_DEFINED = 3, 4

_GPT2 = ("default", "gpt-2", "gpt2", "olmo", "jina-v2-code")
_DIGITS_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3 = ("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe", "pixtral")
_QWEN2 = ("qwen2", "deepseek-r1-qwen")
_TEKKEN = ("tekken",)

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(meta) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config.json) of a `GGUFMetadata`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{meta.path}: GGUF tokenizer {kind!r} is not supported yet "
                         "(supported: gpt2, byte-level BPE; llama, SentencePiece BPE).")
    tokens = meta.token_list
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges,
                                         ignore_merges=pre in _LLAMA3))
        _set_split(tokenizer, pre, meta)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        tokenizer = _sentencepiece(meta, tokens, types, vocab)
    added = [AddedToken(tokens[i], special=t == CONTROL, normalized=False)
             for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    tokenizer.add_tokens(added)
    names = {key: _token(meta, tokens, f"tokenizer.ggml.{key}_token_id")
             for key in ("bos", "eos", "unknown", "padding")}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
                   ) and names["bos"] is not None
    if add_bos:
        bos = names["bos"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    elif kind == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names["bos"], "eos_token": names["eos"], "unk_token": names["unknown"],
        "pad_token": names["padding"], "add_bos_token": add_bos,
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.arch_get("context_length")),
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False,
                     "rstrip": False, "single_word": False, "special": t == CONTROL}
            for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)},
    }
    template = meta.get("tokenizer.chat_template", None)
    if template:
        config["chat_template"] = template
    return tokenizer, config


def _set_split(tokenizer, pre: str, meta) -> None:
    from tokenizers import Regex, normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2:
        tokenizer.pre_tokenizer = byte_level
    elif pre in _DIGITS_GPT2:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3 + _QWEN2 + _TEKKEN:
        split = LLAMA3_SPLIT if pre in _LLAMA3 else QWEN2_SPLIT if pre in _QWEN2 else TEKKEN_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if pre in _QWEN2:
            tokenizer.normalizer = normalizers.NFC()
    else:
        raise ValueError(f"{meta.path}: GGUF pre-tokenizer {pre!r} is not supported yet.")


def _token(meta, tokens: list[str], key: str) -> str | None:
    index = meta.get(key, None)
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None


NORMAL, UNKNOWN, BYTE = 1, 2, 6


def _sentencepiece(meta, tokens: list[str], types: list[int], vocab: dict[str, int]):
    """SentencePiece BPE (module docstring): merges ranked by the joined piece's score."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    scores = list(meta.get("tokenizer.ggml.scores", [0.0] * len(tokens)))
    pieces = {t for t, kind in zip(tokens, types) if kind in (NORMAL, USER_DEFINED)}
    ranked = []
    for token in pieces:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[vocab[token]], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unknown = next((t for t, kind in zip(tokens, types) if kind == UNKNOWN), None)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unknown,
                                     fuse_unk=True, byte_fallback=BYTE in types))
    if bool(meta.get("tokenizer.ggml.add_space_prefix", True)):
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                           prepend_scheme="first", split=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                           prepend_scheme="never", split=False)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True)
          else [])])
    return tokenizer
