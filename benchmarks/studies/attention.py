"""CPU attention over the paged cache (`aserve/kernels/cpu_attention.py`): ms per layer for a
decode batch (and optionally a mixed prefill + decode step), one JSON line.

    python benchmarks/studies/attention.py [--batch 64] [--context 192] [--mixed]
    python benchmarks/studies/attention.py --chunks 2048:2048,8192:2048    # prefill chunks, L:C

Two measures, as a decode step meets them:
- "cold": one call per layer over 30 layers' separate caches, so K/V come from memory (the
  working set of a step is far larger than the caches);
- "hot": the same layer 30 times, its K/V in cache: the kernel's compute alone.
The K/V bytes read per layer and the rate they were read at are given beside each. Block
tables mimic the engine's: each request's first blocks contiguous (its prefill), later ones
interleaved with the other requests' (one per decode step each).

--chunks: one request's prefill chunk of C rows ending at key L (context L - C), one layer, its
K/V in cache: the row-tile kernel for every row against the SDPA path (`attend_chunks`: the
context gathered, a boolean causal mask), ms and attention GFLOP/s each (best of 3), and the
largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: aserve
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common

from common import best_time  # noqa: E402


def block_table(context: list[int], block_size: int, prefill_blocks: int) -> torch.Tensor:
    """[R, max blocks] int32: prefill blocks per request contiguous, then one per request in
    turn, as a batch that decodes together allocates them."""
    width = -(-max(context) // block_size)
    table = np.zeros((len(context), width), np.int32)
    nxt = 0
    for r in range(len(context)):
        for j in range(min(prefill_blocks, width)):
            table[r, j], nxt = nxt, nxt + 1
    for j in range(prefill_blocks, width):
        for r in range(len(context)):
            table[r, j], nxt = nxt, nxt + 1
    return torch.from_numpy(table)


def prefill_chunks(args: argparse.Namespace, module) -> dict:
    """Row tiles against SDPA for each --chunks entry (see the module docstring)."""
    from aserve.kernels.cpu_attention import plan_tiles
    from aserve.kernels.paged_attention import attend_chunks

    hq, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    result = {"benchmark": "attention_chunks", "threads": torch.get_num_threads(),
              "heads": hq, "kv_heads": hkv, "head_dim": d, "chunks": {}}
    for spec in args.chunks.split(","):
        seq_len, rows = map(int, spec.split(":"))
        num_blocks = -(-seq_len // bs)
        k, v = torch.randn(2, num_blocks, bs, hkv, d).bfloat16()
        table = torch.arange(num_blocks, dtype=torch.int32)[None]
        q = torch.randn(rows, hq, d).bfloat16()
        starts, lens = np.array([0, rows]), np.array([seq_len])
        tiles, _ = plan_tiles(starts, lens, long_chunk=1 << 40)
        out_tiles, out_sdpa = torch.empty_like(q), torch.empty_like(q)

        run_tiles = functools.partial(module.attend_rows, q, k, v, table, tiles, out_tiles,
                                      d**-0.5, 0, 0.0, None)
        run_sdpa = functools.partial(attend_chunks, q, k, v, [0, rows], [seq_len], table,
                                     d**-0.5, None, None, out_sdpa, None, None)

        flops = 4 * hq * d * (rows * (seq_len - rows) + rows * rows / 2)
        entry = {}
        for name, fn in (("tiles", run_tiles), ("sdpa", run_sdpa)):
            ms = best_time(fn, 3) * 1e3
            entry[name] = {"ms": round(ms, 2), "gflop_s": round(flops / ms / 1e6, 1)}
        entry["tiles_speedup"] = round(entry["sdpa"]["ms"] / entry["tiles"]["ms"], 2)
        entry["max_abs_diff"] = float((out_tiles.float() - out_sdpa.float()).abs().max())
        result["chunks"][spec] = entry
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="decode rows")
    ap.add_argument("--context", type=int, default=192, help="keys per decode row")
    ap.add_argument("--mixed", action="store_true",
                    help="also 4 prefill chunks of 128 tokens in the step (a mixed step)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunks", default=None, metavar="L:C,...",
                    help="prefill chunks instead: C rows ending at key L")
    args = ap.parse_args()

    from aserve.kernels import cpu_extension
    from aserve.kernels.cpu_attention import plan_tiles

    module = cpu_extension.load()
    if module is None or not module.rows_supported(torch.empty(1, 1, args.head_dim,
                                                               dtype=torch.bfloat16)):
        print(json.dumps({"benchmark": "attention", "error": "no AVX-512 kernel build here"}))
        return 1
    if args.chunks:
        print(json.dumps(prefill_chunks(args, module)))
        return 0
    block_size, hq, hkv, d = args.block_size, args.heads, args.kv_heads, args.head_dim
    q_lens = [1] * args.batch + ([128] * 4 if args.mixed else [])
    context = [args.context] * args.batch + ([128] * 4 if args.mixed else [])
    table = block_table(context, block_size, prefill_blocks=max(1, 128 // block_size))
    num_blocks = int(table.max()) + 1
    caches = [torch.randn(2, num_blocks, block_size, hkv, d).bfloat16()
              for _ in range(args.layers)]
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    tiles, _ = plan_tiles(starts, np.array(context))
    q = torch.randn(int(starts[-1]), hq, d).bfloat16()
    out = torch.empty_like(q)

    def step(layers: list[torch.Tensor]) -> None:
        for c in layers:
            module.attend_rows(q, c[0], c[1], table, tiles, out, d**-0.5, 0, 0.0, None)

    step(caches)  # warm-up
    kv_mb = sum(context) * hkv * d * 2 * 2 / 1e6  # K and V, bf16
    result = {"benchmark": "attention", "threads": torch.get_num_threads(),
              "batch": args.batch, "context": args.context, "mixed": args.mixed,
              "kv_mb_per_layer": round(kv_mb, 2)}
    for name, layers in (("cold", caches), ("hot", [caches[0]] * args.layers)):
        ms = best_time(lambda layers=layers: step(layers), 5) / args.layers * 1e3
        result[name] = {"ms_per_layer": round(ms, 3), "kv_gb_per_s": round(kv_mb / ms, 1)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
