"""Quantized models side by side (issue 42): batch-1 TPOT and c=32 throughput of aserve on GGUF
files of one model in several quant types, against aserve's own bf16 and llama.cpp's
`llama-bench` on the same files. Prints one JSON line.

    python benchmarks/quantized.py --gguf bf16.gguf Q8_0.gguf Q4_1.gguf ... \
        [--llamacpp-venv ~/.cache/aserve-peers/llamacpp-venv] [-o 128] [--batch 32]

The first file is the baseline (a BF16 or F16 GGUF: aserve's bf16 GEMM). aserve loads every
file at once, each in a process of its own, and measures them in turns, --repeats rounds (this
host's speed drifts by a third within minutes; in turns, the drift falls on every file alike),
never two timings at once:

- batch 1: one request, -i prompt tokens, -o greedy tokens (ignore_eos); TPOT from the
  engine's step log (first token's step to the last's), the best and the median of the rounds;
- c=32: --batch requests of -i tokens each, -o tokens each, at once; output tokens / wall
  seconds (prefill included), the best of the rounds;
- resident: the packed linear weights' bytes (integer and bf16) as the runner holds them, and
  what loading added to the process's resident set;
- llama.cpp: `llama-bench -p 0 -n O -t cores -r R` on the same file (needs
  ../shared/peers/setup_llamacpp.sh's venv; skipped if it is missing).

Ratios: each file's aserve TPOT over aserve's bf16 (goals: int8 <= 0.65, int4 <= 0.45), over
llama.cpp's on the same file (goal <= 1), and its c=32 throughput over bf16's (goal >= 1).
Files of another model in the same types: make them with llama.cpp's quantizer
(`llama_cpp.llama_model_quantize`, `--make-from F.gguf` does Q8_0, Q4_K_M and BF16 next to it;
`--types BF16 Q8_0 Q4_0 ...` others, and then measures those alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import emit, make_prompts, vocab_size_of  # noqa: E402

MADE = ("BF16", "Q8_0", "Q4_K_M")  # what --make-from writes unless --types says


def make_files(source: Path, venv: Path, types: tuple[str, ...] = MADE) -> list[Path]:
    """Files of these llama.cpp types (`LLAMA_FTYPE_MOSTLY_<type>`) requantized from `source`
    by its quantizer, beside it."""
    code = (
        "import sys, llama_cpp\n"
        "src, out, name = sys.argv[1:]\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = getattr(llama_cpp, 'LLAMA_FTYPE_MOSTLY_' + name)\n"
        "p.allow_requantize = True\n"
        "sys.exit(llama_cpp.llama_model_quantize(src.encode(), out.encode(), p))\n")
    quantize = venv / "bin" / "llama-quantize"  # install.sh builds it; else llama_cpp's
    made = []
    for name in types:
        out = source.with_name(f"{source.name.split('.')[0]}.{name}.gguf")
        if not out.exists():
            command = ([str(quantize), "--allow-requantize", str(source), str(out), name]
                       if quantize.exists() else
                       [str(venv / "bin" / "python"), "-c", code, str(source), str(out), name])
            subprocess.run(command, check=True, capture_output=True, timeout=1800)
        made.append(out)
    return made


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


class Engine:
    """One file served by aserve in this process (KV cache sized for the runs)."""

    def __init__(self, args: argparse.Namespace, path: Path) -> None:
        from aserve import LLM, SamplingParams
        from aserve.kernels.cpu_gemm import PackedWeight
        from aserve.kernels.cpu_qgemm import QuantPackedWeight
        from aserve.quantization.gguf_file import gguf_model_dir

        before = resident_mb()
        self.llm = LLM(str(path), dtype="bfloat16", max_num_seqs=args.batch,
                       max_model_len=args.input_len + args.output_len + 8,
                       kv_cache_memory=args.batch * (args.input_len + args.output_len + 32)
                       * 256 * 1024)  # (a 8B model: 128 KB a token)
        self.resident_mb = resident_mb() - before
        self.packed = {"int": 0, "bf16": 0}
        for module in self.llm.engine_core.executor.worker.runner.model.modules():
            weight = getattr(module, "packed_weight", None)
            if isinstance(weight, QuantPackedWeight):
                self.packed["int"] += weight.nbytes
            elif isinstance(weight, PackedWeight):
                self.packed["bf16"] += weight.data.numel() * 2
        vocab = vocab_size_of(gguf_model_dir(path))
        self.one = {"prompt_token_ids": make_prompts(1, args.input_len, vocab)[0]}
        self.many = [{"prompt_token_ids": p}
                     for p in make_prompts(args.batch, args.input_len, vocab, seed=1)]
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                     ignore_eos=True)
        self.llm.generate([self.one], SamplingParams(temperature=0.0, max_tokens=4,
                                                     ignore_eos=True))
        self.tpots: list[float] = []
        self.rates: list[float] = []

    def batch1(self) -> None:
        """One request: its TPOT from the engine's step log, first token's step to the last."""
        core = self.llm.engine_core
        self.llm.reset_prefix_cache()
        since = time.monotonic()
        self.llm.generate([self.one], self.params)
        steps = [s for s in core.step_log.snapshot() if s[0] >= since]
        ends = [steps[0][0]] + [s[0] for s in steps if s[1] == 0]
        self.tpots.append(1000 * (ends[-1] - ends[0]) / (len(ends) - 1))

    def concurrent(self) -> None:
        """--batch requests at once: output tokens over wall seconds (prefill included)."""
        self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = self.llm.generate(self.many, self.params)
        wall = time.perf_counter() - t0
        self.rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)

    def result(self, batch: int) -> dict:
        return {"tpot_ms": round(min(self.tpots), 3),
                "tpot_median_ms": round(statistics.median(self.tpots), 3),
                f"c{batch}_tok_s": round(max(self.rates), 1),
                "packed_int_mb": round(self.packed["int"] / 1e6, 1),
                "packed_bf16_mb": round(self.packed["bf16"] / 1e6, 1),
                "resident_mb": round(self.resident_mb, 1)}


class Child:
    """A process serving one file (`--serve-file`), measuring when asked: each file is loaded
    once, in a process of its own (two engines in one process slowed both by a half: each
    worker thread has its own OpenMP team, and idle teams spin), and measured in turns."""

    def __init__(self, args: argparse.Namespace, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-file", str(path), "-i", str(args.input_len),
             "-o", str(args.output_len), "--batch", str(args.batch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ask("ready")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the process serving a file ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def serve_file(args: argparse.Namespace) -> None:
    """--serve-file: load it, then run each command read from stdin, a JSON line each."""
    engine = Engine(args, args.serve_file)
    actions = {"ready": lambda: None, "batch1": engine.batch1, "concurrent": engine.concurrent}
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    for line in sys.stdin:
        command = line.strip()
        answer = engine.result(args.batch) if command == "result" else actions[command]()
        out.write(json.dumps(answer or {}) + "\n")
        out.flush()
    engine.llm.engine_core.shutdown()


def run_llamacpp(args: argparse.Namespace, path: Path) -> dict | None:
    bench = args.llamacpp_venv.expanduser() / "bin" / "llama-bench"
    if not bench.exists():
        return None
    cmd = [str(bench), "-m", str(path), "-p", "0", "-n", str(args.output_len),
           "-t", str(os.cpu_count()), "-r", str(args.repeats), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    (row,) = [r for r in json.loads(out.stdout) if r.get("n_gen")]
    return {"tpot_ms": round(1000 / row["avg_ts"], 3), "tokens_per_s": round(row["avg_ts"], 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, nargs="*", default=[])
    p.add_argument("--make-from", type=Path, default=None,
                   help="a GGUF to requantize into BF16, Q8_0 and Q4_K_M files (llama.cpp's "
                        "quantizer), measured with it")
    p.add_argument("--types", nargs="+", default=None,
                   help="with --make-from: the types to make (the first the baseline, BF16), "
                        "measured without the source file")
    p.add_argument("--llamacpp-venv", type=Path,
                   default=Path("~/.cache/aserve-peers/llamacpp-venv"))
    p.add_argument("-i", "--input-len", type=int, default=16)
    p.add_argument("-o", "--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="rounds of aserve's runs; "
                   "llama-bench's -r")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--serve-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_file is not None:
        serve_file(args)
        return 0
    files = list(args.gguf)
    if args.make_from is not None:
        venv = args.llamacpp_venv.expanduser()
        if args.types:
            files = [*make_files(args.make_from, venv, tuple(args.types)), *files]
        else:
            made = make_files(args.make_from, venv)
            files = [made[0], made[1], args.make_from, *made[2:], *files]
    if len(files) < 2:
        raise SystemExit("give a bf16 GGUF and quantized ones (--gguf), or --make-from F.gguf")
    import torch

    result = {"benchmark": "quantized", "threads": torch.get_num_threads(),
              "input_len": args.input_len, "output_len": args.output_len, "batch": args.batch,
              "rounds": args.repeats, "files": {}}
    children = [Child(args, path) for path in files]
    for _ in range(args.repeats):  # in turns, so that the host's drift falls on every file
        for child in children:
            child.ask("batch1")
        for child in children:
            child.ask("concurrent")
    for path, child in zip(files, children, strict=True):
        result["files"][path.name] = {"aserve": child.ask("result")}
        child.close()
    for path in files:
        row = result["files"][path.name]
        llamacpp = run_llamacpp(args, path)
        if llamacpp is not None:
            row["llamacpp"] = llamacpp
            row["aserve_tpot_over_llamacpp"] = round(row["aserve"]["tpot_ms"]
                                                     / llamacpp["tpot_ms"], 3)
    base = result["files"][files[0].name]["aserve"]
    for row in result["files"].values():
        row["tpot_over_bf16"] = round(row["aserve"]["tpot_ms"] / base["tpot_ms"], 3)
        key = f"c{args.batch}_tok_s"
        row[f"c{args.batch}_over_bf16"] = round(row["aserve"][key] / base[key], 3)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
