"""Perplexity of a quantized model's fast path against its float reference, on real text
(issue 42: within 3 %). Prints one JSON line.

    python benchmarks/perplexity.py --model F.gguf [--chunks 16] [--chunk-len 256]

The text is English prose every Python has: the documentation topics of `pydoc_data.topics`
(the language reference's sections), in a fixed order, tokenized by the model's tokenizer and
cut into --chunks windows of --chunk-len tokens. Each path scores every window with
`prompt_logprobs=0` (the log-probability of each actual next token); perplexity =
exp(-mean log-probability) over all scored tokens. Paths, each in a process of its own:

- reference: --dtype float32, weights dequantized at load (greedy-equal to HF transformers);
- bf16: --dtype bfloat16 --dequantize: bf16 weights and activations, no integer kernels;
- quantized: --dtype bfloat16, the weights kept as integers (int4 / int8 GEMM with int8
  activations) where the platform has the kernel.

`ratio` is each path's perplexity over the reference's (goal for `quantized`: <= 1.03).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import emit  # noqa: E402

PATHS = {"reference": {"dtype": "float32", "dequantize": True},
         "bf16": {"dtype": "bfloat16", "dequantize": True},
         "quantized": {"dtype": "bfloat16", "dequantize": False}}


def windows(tokenizer, chunks: int, chunk_len: int) -> list[list[int]]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < chunks * chunk_len:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {chunks} x {chunk_len}")
    step = len(ids) // chunks  # spread over the whole text
    return [ids[i * step:i * step + chunk_len] for i in range(chunks)]


def score(args: argparse.Namespace, path: str) -> dict:
    """Sum and count of the next-token log-probabilities of every window, on one path."""
    from aserve import LLM, SamplingParams
    from aserve.engine.tokenizer import Tokenizer
    from aserve.quantization.gguf_file import gguf_model_dir, is_gguf

    llm = LLM(args.model, max_model_len=args.chunk_len + 8, warmup=False, **PATHS[path])
    tokenizer = Tokenizer.from_dir(gguf_model_dir(args.model) if is_gguf(args.model)
                                   else args.model)
    prompts = windows(tokenizer, args.chunks, args.chunk_len)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    total, count = 0.0, 0
    for prompt, out in zip(prompts, outs, strict=True):
        for token, entry in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
            total += entry[token].logprob
            count += 1
    return {"logprob_sum": total, "tokens": count}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--path", choices=sorted(PATHS), help=argparse.SUPPRESS)  # one, in-process
    args = p.parse_args(argv)
    if args.path:
        print(json.dumps(score(args, args.path)), flush=True)
        return 0
    result = {"benchmark": "perplexity", "model": args.model, "chunks": args.chunks,
              "chunk_len": args.chunk_len, "text": "pydoc_data.topics"}
    for path in PATHS:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--chunks",
                              str(args.chunks), "--chunk-len", str(args.chunk_len),
                              "--path", path], capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise SystemExit(f"{path}: {out.stderr[-2000:]}")
        scored = json.loads(out.stdout.strip().splitlines()[-1])
        result[path] = {"perplexity": round(math.exp(-scored["logprob_sum"] / scored["tokens"]),
                                            4), "tokens": scored["tokens"]}
    for path in ("bf16", "quantized"):
        result[path]["ratio"] = round(result[path]["perplexity"]
                                      / result["reference"]["perplexity"], 4)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
