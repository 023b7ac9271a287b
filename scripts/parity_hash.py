"""Fingerprints of what aserve generates on the tests' tiny models, for refactors that must not
change behaviour: greedy and seeded-sampled tokens, their top-5 logprobs (bit for bit), prompt
logprobs, constrained and `min_tokens` rows, under schedules that chunk, queue and preempt, in
float32 and bfloat16. Prints one JSON line {case: sha256}; run it before and after a change
(the same torch, tokenizers and CPU) and compare.

    python scripts/parity_hash.py [--models llama,qwen3,...] [--out F]
    python scripts/parity_hash.py --compare before.json after.json

Models are built with tests/helpers/hf_models.py (seeded random weights) under --model-dir
(default: a temporary directory), so a tree's own helpers build them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# a dense Llama; sliding windows (Qwen2, Mistral) and hybrid groups with soft-caps (Gemma 2/3);
# q/k norms (Qwen3); mixtures of experts (Mixtral; gpt-oss: sinks, biased routing)
MODELS = ["llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "mixtral", "gpt_oss"]
PROMPT_LENS = [5, 20, 37, 60, 90, 130]
SCHEDULES = {  # name -> LLM keyword arguments
    "default": {},
    "chunked": {"max_num_batched_tokens": 32, "max_num_seqs": 4},
    "preempting": {"num_kv_blocks": 24, "max_num_batched_tokens": 64, "max_model_len": 256},
    "no_prefix_cache": {"enable_prefix_caching": False, "async_scheduling": False},
}


def build(name: str, root: Path) -> Path:
    from helpers.hf_models import MOE_CASES, SLIDING_CASES, make_hf_model

    out = root / name
    if (out / "config.json").exists():
        return out
    if name in SLIDING_CASES:
        arch, overrides = SLIDING_CASES[name]
        return make_hf_model(out, arch, **overrides)
    if name in MOE_CASES:
        arch, overrides = MOE_CASES[name]
        return make_hf_model(out, arch, **overrides)
    return make_hf_model(out, name)


def digest(outputs) -> str:
    h = hashlib.sha256()
    for out in outputs:
        h.update(repr(out.prompt_token_ids).encode())
        if out.prompt_logprobs is not None:
            for step in out.prompt_logprobs:
                for token, lp in sorted((step or {}).items()):
                    h.update(struct.pack("<qd", token, lp.logprob))
        for completion in sorted(out.outputs, key=lambda c: c.index):
            h.update(repr((completion.token_ids, completion.finish_reason)).encode())
            for step in completion.logprobs or []:
                for token, lp in sorted(step.items()):
                    h.update(struct.pack("<qd", token, lp.logprob))
    return h.hexdigest()


def cases(model_dir: Path, dtype: str, schedule: dict, vocab: int) -> dict[str, str]:
    from aserve import LLM, SamplingParams
    from aserve.sampling_params import StructuredOutputsParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    llm = None
    for extra in (0, 8, 16, 32, 64):  # the fewest blocks that hold one request (preemptions)
        kwargs = {"max_model_len": 512, **schedule}
        if "num_kv_blocks" in kwargs:
            kwargs["num_kv_blocks"] += extra
        try:
            llm = LLM(str(model_dir), dtype=dtype, **kwargs)
            break
        except ValueError as e:
            if "could never run" not in str(e):
                raise
    try:
        def run(params, chosen=prompts):
            return digest(llm.generate([{"prompt_token_ids": p} for p in chosen], params))

        return {
            "greedy": run(SamplingParams(temperature=0, max_tokens=24, logprobs=5,
                                         ignore_eos=True)),
            "sampled_n2": run(SamplingParams(temperature=0.8, top_p=0.9, top_k=50, n=2,
                                             seed=7, max_tokens=16, logprobs=2,
                                             ignore_eos=True)),
            "prompt_logprobs": run(SamplingParams(temperature=0, max_tokens=4,
                                                  prompt_logprobs=3), prompts[:3]),
            "min_tokens": run(SamplingParams(temperature=0, max_tokens=12, min_tokens=8,
                                             stop_token_ids=list(range(3, 60)))),
            "regex": run(SamplingParams(temperature=0, max_tokens=12, structured_outputs=(
                StructuredOutputsParams(regex=r"[a-e ]{3,20}"))), prompts[:4]),
        }
    finally:
        llm.shutdown()


def fingerprint(names: list[str], model_root: Path) -> dict[str, str]:
    result = {}
    for name in names:
        model_dir = build(name, model_root)
        config = json.loads((model_dir / "config.json").read_text())
        vocab = (config.get("text_config") or config)["vocab_size"]
        for dtype in ("float32", "bfloat16"):
            for schedule_name, schedule in SCHEDULES.items():
                if dtype == "bfloat16" and schedule_name not in ("default", "chunked"):
                    continue
                for case, value in cases(model_dir, dtype, schedule, vocab).items():
                    key = f"{name}/{dtype}/{schedule_name}/{case}"
                    result[key] = value
                    print(f"{key} {value[:12]}", file=sys.stderr, flush=True)
    return result


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differ = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    missing = sorted(a.keys() ^ b.keys())
    print(json.dumps({"same": len(a.keys() & b.keys()) - len(differ), "differ": differ,
                      "missing": missing}))
    return 1 if differ or missing else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.model_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        result = fingerprint(args.models.split(","), root)
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
