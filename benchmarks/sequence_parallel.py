"""Sequence parallelism (Ulysses, issue 21): prefill time to first token of long prompts with
sp=2 beside tp=2 and one rank, the longest context a fixed KV budget per rank holds under each,
and the communication of one layer (SP's two all-to-alls against TP's two all-reduces), on a
SmolLM2-135M-shaped and a Llama-3.2-1B-shaped random-weight model. Prints one JSON line
(progress goes to stderr).

    python benchmarks/sequence_parallel.py [--shapes smol,1b] [--prompt-lens 2048,...,16384]
        [--layouts one,tp2,sp2] [--rounds 2] [--kv-budget-gib 0.25] [--workdir DIR] [--out F]
    python benchmarks/sequence_parallel.py --quick     # a tiny model and prompts: structure only

TTFT: one request at a time (--max-tokens 1, synchronous steps, chunks of --chunk tokens), the
best of --rounds per (layout, length) after a warm-up request; `ratios` divides each layout's
TTFT by one rank's. KV: each layout started with --kv-cache-memory = the budget on every rank;
the cache's tokens (blocks × block size) are what one request's context can reach. Comm: two
gloo ranks time, per layer of a T-token prefill, SP's q/k/v and output all-to-alls (each rank's
T/2 rows, its heads) and TP's two all-reduces of [T, hidden] (o_proj and down_proj), best of
5 × --rounds calls each.

What 2 cores can and cannot show: two ranks on two cores are two single-threaded workers, so
sp=2 and tp=2 can only be compared with each other and with one rank of two threads; gloo over
loopback is memory copies, not NVLink or a network. The KV figures are exact counts; the times
are this machine's only and say nothing of GPUs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from common import emit, free_port, make_prompts  # noqa: E402
from compare import loadavg, machine  # noqa: E402
from sliding_window import init_bf16, save_bf16, write_tokenizer  # noqa: E402

# name -> LlamaConfig keys. SmolLM2-135M has 9 heads / 3 kv heads, which no pair of ranks
# splits: its widths with 8 heads / 2 kv heads of 64.
SHAPES = {
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=49152),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512),
}
LAYOUTS = {"one": {}, "tp2": {"tensor_parallel_size": 2}, "sp2": {"sequence_parallel_size": 2}}
QUICK = dict(shapes="tiny", prompt_lens="64,160", comm_lens="64", rounds=1, chunk=64,
             kv_budget_gib=0.001)


def log(message: str) -> None:
    print(f"[sequence_parallel {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


def make_model(shape: str, out: Path, max_len: int) -> Path:
    """A random-weight LlamaForCausalLM of `shape` (bf16) and a tokenizer, kept if present."""
    if (out / "config.json").exists():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    keys = SHAPES[shape]
    vocab = write_tokenizer(out, min(keys["vocab_size"], 4096), 0.2, max_len)
    config = LlamaConfig(**keys, max_position_embeddings=max_len, rms_norm_eps=1e-6,
                         initializer_range=0.3 * (64 / keys["hidden_size"]) ** 0.5,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    save_bf16(init_bf16(LlamaForCausalLM, config, seed=0), out, vocab, t0)
    return out


def ttft(args: argparse.Namespace, model_dir: Path, layout: str, vocab: int) -> dict:
    """Best seconds to the first token per prompt length, under `layout`."""
    from aserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    lens = args.prompt_lens
    with LLM(str(model_dir), max_model_len=max(lens) + 8, max_num_batched_tokens=args.chunk,
             async_scheduling=False, enable_prefix_caching=False, **LAYOUTS[layout]) as llm:
        llm.generate([{"prompt_token_ids": make_prompts(1, 16, vocab)[0]}], params)  # warm-up
        best = {}
        for n in lens:
            times = []
            for r in range(args.rounds):
                prompt = make_prompts(1, n, vocab, seed=r + 1)[0]
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], params)
                times.append(time.perf_counter() - t0)
            best[str(n)] = round(min(times), 4)
            log(f"{model_dir.name} {layout} {n} tokens: TTFT {best[str(n)]:.3f} s")
    return best


def kv_context(args: argparse.Namespace, model_dir: Path, layout: str) -> dict:
    """What a cache of the budget on every rank holds under `layout`."""
    from aserve import LLM

    budget = int(args.kv_budget_gib * 2**30)
    # (max_num_seqs: the engine caps the cache at what that many requests could use)
    with LLM(str(model_dir), kv_cache_memory=budget, max_model_len=64, block_size=16,
             max_num_seqs=1 << 16, **LAYOUTS[layout]) as llm:
        num_blocks = llm.engine_core.num_blocks
        kv_heads = llm.engine_core.executor.worker.runner.num_kv_heads
    return {"kv_heads_per_rank": kv_heads, "num_blocks": num_blocks,
            "max_context_tokens": (num_blocks - 1) * 16}  # (less the null block)


def _best_of(fn, repeats: int) -> float:
    """Best seconds of `repeats` calls after a warm-up: a fixed count, the same on both ranks
    (`common.best_time` stops on its own clock, and collectives would then not pair up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _layer_comm(keys: dict, num_tokens: int, repeats: int) -> dict:
    """Milliseconds of one layer's collectives for a prefill of `num_tokens`, on 2 ranks."""
    import torch
    import torch.distributed as dist

    from aserve.distributed.all_to_all import exchange_rows

    d, heads, kv_heads = keys["head_dim"], keys["num_attention_heads"], keys["num_key_value_heads"]
    half = [num_tokens // 2] * 2  # each rank's rows, sent half to each rank
    qkv = torch.randn(sum(half), (heads // 2 + 2 * max(1, kv_heads // 2)) * d,
                      dtype=torch.bfloat16)  # [T, its heads' q / k / v]
    out = torch.randn(sum(half), heads // 2 * d, dtype=torch.bfloat16)
    hidden = torch.randn(num_tokens, keys["hidden_size"], dtype=torch.bfloat16)

    def sp_layer() -> None:
        exchange_rows(qkv, half, half, dist.group.WORLD)
        exchange_rows(out, half, half, dist.group.WORLD)

    def tp_layer() -> None:
        dist.all_reduce(hidden)
        dist.all_reduce(hidden)

    return {"sp2_all_to_all_ms": round(_best_of(sp_layer, repeats) * 1e3, 3),
            "tp2_all_reduce_ms": round(_best_of(tp_layer, repeats) * 1e3, 3)}


def _comm_rank(rank: int, port: int, keys: dict, lens: list[int], repeats: int,
               out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    figures = {str(n): _layer_comm(keys, n, repeats) for n in lens}
    if rank == 0:
        Path(out).write_text(repr(figures))
    dist.barrier()
    dist.destroy_process_group()


def comm(keys: dict, lens: list[int], repeats: int, workdir: Path) -> dict:
    """Per layer of a prefill of each length: SP's and TP's collectives, two gloo ranks."""
    import ast

    import torch.multiprocessing as mp

    out = workdir / "comm.txt"
    mp.start_processes(_comm_rank, args=(free_port(), keys, lens, repeats, str(out)),
                       nprocs=2, start_method="spawn")
    return ast.literal_eval(out.read_text())


def run_shape(args: argparse.Namespace, shape: str) -> dict:
    max_len = max(args.prompt_lens) + 64  # (in the name: a cached model must be long enough)
    model_dir = make_model(shape, args.workdir / f"llama-{shape}-{max_len}", max_len)
    vocab = min(SHAPES[shape]["vocab_size"], 4096)
    report = {"shape": SHAPES[shape], "ttft_s": {}, "kv": {}}
    for layout in args.layouts:
        report["ttft_s"][layout] = ttft(args, model_dir, layout, vocab)
        report["kv"][layout] = kv_context(args, model_dir, layout)
    one = report["ttft_s"].get("one")
    report["ttft_over_one_rank"] = {
        layout: {n: round(t / one[n], 3) for n, t in times.items()}
        for layout, times in report["ttft_s"].items() if one and layout != "one"}
    report["comm_per_layer"] = comm(SHAPES[shape], args.comm_lens, 5 * args.rounds,
                                    args.workdir)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model: structure only")
    parser.add_argument("--shapes", default=None, help="comma-separated: smol, 1b (tiny)")
    parser.add_argument("--prompt-lens", default=None, help="default 2048,4096,8192,16384")
    parser.add_argument("--comm-lens", default=None, help="default: the prompt lengths")
    parser.add_argument("--layouts", default="one,tp2,sp2")
    parser.add_argument("--rounds", type=int, default=None, help="default 2")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 2048)")
    parser.add_argument("--kv-budget-gib", type=float, default=None, help="default 0.25")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/aserve-sp-bench"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else dict(
        shapes="smol,1b", prompt_lens="2048,4096,8192,16384", comm_lens=None, rounds=2,
        chunk=2048, kv_budget_gib=0.25)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shapes = args.shapes.split(",")
    args.layouts = args.layouts.split(",")
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    args.comm_lens = ([int(n) for n in args.comm_lens.split(",")] if args.comm_lens
                      else args.prompt_lens)
    unknown = set(args.shapes) - SHAPES.keys() or set(args.layouts) - LAYOUTS.keys()
    if unknown:
        parser.error(f"unknown shape or layout: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "sequence_parallel", "machine": machine(), "loadavg": loadavg(),
              "prompt_lens": args.prompt_lens, "chunk": args.chunk, "rounds": args.rounds,
              "kv_budget_gib": args.kv_budget_gib,
              "shapes": {shape: run_shape(args, shape) for shape in args.shapes}}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
