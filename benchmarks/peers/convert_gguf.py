#!/usr/bin/env python3
"""llama.cpp's HF -> GGUF converter, for the benchmarks' random-weight models:

    python convert_gguf.py LLAMA_CPP_DIR MODEL_DIR --outtype bf16 --outfile OUT.gguf

LLAMA_CPP_DIR is a llama.cpp source tree (install.sh uses the llama-cpp-python sdist's
`vendor/llama.cpp`); every argument after it goes to its `convert_hf_to_gguf.py` unchanged.

The converter names a BPE tokenizer's pre-tokenizer by the hash of how it splits a test text,
and stops ("BPE pre-tokenizer was not recognized") on any hash outside its table, which the
tokenizers make_model.py trains are. Theirs is a plain ByteLevel pre-tokenizer with GPT-2's
regex, which llama.cpp calls "gpt-2": for such a tokenizer, and only then, this answers that
name where the table has none.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def is_gpt2_byte_level(model_dir: str | Path) -> bool:
    try:
        tokenizer = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return False
    pre = tokenizer.get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def main() -> int:
    llama_dir = Path(sys.argv.pop(1)).resolve()
    sys.path.insert(0, str(llama_dir))
    sys.argv[0] = str(llama_dir / "convert_hf_to_gguf.py")
    import convert_hf_to_gguf  # puts llama.cpp's gguf-py on sys.path
    from conversion.base import TextModel

    known_pre = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known_pre(self, tokenizer)
        except NotImplementedError:
            if not is_gpt2_byte_level(self.dir_model):
                raise
            print("convert_gguf: unknown BPE hash, a GPT-2 ByteLevel pre-tokenizer: 'gpt-2'",
                  file=sys.stderr)
            return "gpt-2"

    TextModel.get_vocab_base_pre = vocab_base_pre
    return convert_hf_to_gguf.main() or 0


if __name__ == "__main__":
    sys.exit(main())
