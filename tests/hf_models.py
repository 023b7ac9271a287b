"""Builders for tiny HF model directories used by the tests: a byte-level BPE tokenizer trained
here with `tokenizers`, and (in `make_hf_model`) random-weight transformers models saved with
`save_pretrained`. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks, like pages of memory.",
    "Continuous batching lets finished requests leave and new ones join every step.",
    "Hello! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1024 3.14159",
    "Emoji make people smile 😀😃🎉🚀👍🏽 and hearts ❤️ too.",
    "中文文本测试：你好，世界！今天天气很好。",
    "日本語のテキスト：こんにちは世界。ありがとうございます。",
    "한국어 문장: 안녕하세요 세계.",
    "Ünïcödé äccents: café, naïve, résumé, São Paulo, Zürich.",
    "Tabs\tand  double  spaces, and new\nlines\n\nand more.",
]


def corpus(repeats: int = 40) -> list[str]:
    return [f"{s} {i % 7}" for i in range(repeats) for s in _SENTENCES]


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512,
                    model_max_length: int = 2048) -> Path:
    """Train a byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, s in enumerate(SPECIAL_TOKENS)
    }
    tok_cfg = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out
