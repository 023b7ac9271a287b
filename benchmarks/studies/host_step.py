"""What an engine step costs the host, phase by phase, with the model's forward taken out.
Prints one JSON line.

    python benchmarks/studies/host_step.py --model DIR [-n 256] [-i 16] [-o 128] [--rounds 5]
        [--async-scheduling] [--real-forward] [--opcodes] [--against DIR]

The engine runs offline (`-n` requests of `-i` random prompt tokens, `-o` greedy output tokens,
`ignore_eos`), but the model's forward returns zeros at once and its LM head hands out rows of a
fixed random logits table: what is left of a step is the host's work alone — scheduling, the
runner's inputs and states, sampling (argmax over the real vocabulary), the scheduler's update
and the outputs — which is what a GPU's steady state waits on (issue 45) and what a near-free
model measures on a CPU with the forward's threads in the way. Sync scheduling by default, so
that each phase's time is its own; `--real-forward` keeps the model.

Per round: ms a step (wall), and per phase its ms a step (`time.perf_counter` around each call):
`schedule`, `update` (`Scheduler.update_from_output`), `outputs`
(`OutputProcessor.process_outputs`), `runner_inputs` (`ModelRunner.start_step` less the
forward), `forward` (`run_model`: with the stub, the attention metadata and the stub's calls),
`runner_sample` (`finish_step`), and `other` (the step less all of these: the hand-offs between
the engine and worker threads, the engine's loop). Medians over rounds.

`--opcodes` runs one more round with the engine's and the runner's threads traced
(`sys.settrace` opcode events, ~50x slower) and reports the bytecodes a step each thread
executed, and the functions that executed the most: deterministic where wall time is not (this
host's speed swings 30 % within a minute), a count of the Python work only (a call costs more
than a load, C code nothing).

`--against DIR` compares this tree with another checkout (`git worktree add DIR REV`; it must
have this script): each tree's engine lives in its own process, built once, and the rounds
alternate between them (the order flipping every round), so that the machine's slow and fast
minutes fall on both; reported per tree, with the median of the rounds' ratios (this tree over
DIR's, below 1: this tree is cheaper).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS.parent))  # the repo: aserve
sys.path.insert(0, str(BENCHMARKS))  # common

from common import emit, make_prompts, vocab_size_of  # noqa: E402

# (label, class path, method): the calls timed, each inclusive
TIMED = (("schedule", "aserve.core.scheduler.Scheduler", "schedule"),
         ("update", "aserve.core.scheduler.Scheduler", "update_from_output"),
         ("outputs", "aserve.engine.output_processor.OutputProcessor", "process_outputs"),
         ("start_step", "aserve.runner.model_runner.ModelRunner", "start_step"),
         ("forward", "aserve.runner.model_runner.ModelRunner", "run_model"),
         ("runner_sample", "aserve.runner.model_runner.ModelRunner", "finish_step"))


def time_calls(seconds: dict[str, float]) -> None:
    """Wrap each TIMED method so that its calls add their wall time to `seconds[label]`."""
    import importlib

    for label, path, name in TIMED:
        module, cls = path.rsplit(".", 1)
        owner = getattr(importlib.import_module(module), cls)
        fn = getattr(owner, name)

        def timed(*args, _fn=fn, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - start

        setattr(owner, name, functools.wraps(fn)(timed))


def stub_forward(llm, vocab_size: int, max_rows: int) -> None:
    """The model's forward returns zeros; its LM head, rows of a fixed random table."""
    import torch

    runner = llm.engine_core.executor.worker.runner
    model = runner.model
    hidden_size = runner.arch.hidden_size
    table = torch.randn(max_rows, vocab_size, generator=torch.Generator().manual_seed(0))

    def forward(input_ids, positions, metadata, intermediate=None):
        return torch.zeros(len(input_ids), hidden_size, dtype=runner.arch.dtype)

    def compute_logits(hidden):
        return table[:len(hidden)]

    model.forward = forward
    model.compute_logits = compute_logits


class Engine:
    """One tree's engine (`--worker` in a child process), stubbed and warm: one round a call."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        script = root / "benchmarks" / "studies" / "host_step.py"
        flags = ["-n", str(args.num_prompts), "-i", str(args.input_len), "-o",
                 str(args.output_len)] + [f for f, on in (
                     ("--async-scheduling", args.async_scheduling),
                     ("--real-forward", args.real_forward)) if on]
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "--model", args.model, "--worker", *flags],
            cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the engine process exited ({self.proc.wait()})")

    def round(self) -> dict[str, float]:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def build(args: argparse.Namespace):
    """A warm engine with the TIMED calls wrapped (and the forward stubbed), and one round."""
    from aserve import LLM, SamplingParams

    seconds: dict[str, float] = defaultdict(float)
    time_calls(seconds)
    llm = LLM(args.model, max_num_seqs=args.num_prompts,
              async_scheduling=args.async_scheduling)
    vocab_size = vocab_size_of(args.model)
    if not args.real_forward:
        stub_forward(llm, vocab_size, args.num_prompts * args.input_len)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(
        args.num_prompts, args.input_len, vocab_size)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params)  # warm

    def one_round() -> dict[str, float]:
        llm.reset_prefix_cache()
        seconds.clear()
        steps_before = llm.engine_core.num_steps
        start = time.perf_counter()
        llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        steps = llm.engine_core.num_steps - steps_before
        per_step = {label: 1000 * s / steps for label, s in seconds.items()}
        row = {"step": 1000 * elapsed / steps,
               "schedule": per_step["schedule"], "update": per_step["update"],
               "outputs": per_step["outputs"],
               "runner_inputs": per_step["start_step"] - per_step["forward"],
               "forward": per_step["forward"], "runner_sample": per_step["runner_sample"]}
        row["other"] = row["step"] - sum(v for k, v in row.items() if k != "step")
        row["steps"] = steps
        return row

    return llm, one_round


def count_opcodes(llm, one_round) -> dict:
    """One round with the engine's and the worker's bytecodes counted: a step's, per thread
    and for the functions that ran the most."""
    per_thread: Counter = Counter()
    per_function: Counter = Counter()

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            per_thread[threading.current_thread().name] += 1
            per_function[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return tracer

    worker = llm.engine_core.executor._thread  # (the runner's thread: traced from inside it)
    worker.submit(sys.settrace, tracer).result()
    sys.settrace(tracer)
    try:
        row = one_round()
    finally:
        sys.settrace(None)
        worker.submit(sys.settrace, None).result()
    steps = row["steps"]
    return {"per_thread": {k: round(v / steps) for k, v in per_thread.items()},
            "total": round(sum(per_thread.values()) / steps),
            "top_functions": {k: round(v / steps) for k, v in per_function.most_common(15)}}


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("-n", "--num-prompts", type=int, default=256)
    ap.add_argument("-i", "--input-len", type=int, default=16)
    ap.add_argument("-o", "--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="per tree")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--real-forward", action="store_true")
    ap.add_argument("--opcodes", action="store_true", help="count bytecodes a step (one round)")
    ap.add_argument("--against", type=Path, help="another checkout, alternated round by round")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = {"benchmark": "host_step", "model": args.model,
              "requests": f"{args.num_prompts} x {args.input_len}/{args.output_len}",
              "async_scheduling": args.async_scheduling,
              "forward": "real" if args.real_forward else "stub", "rounds": args.rounds}

    if args.worker:  # a child of --against: one round per line read
        llm, one_round = build(args)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() == "round":
                print(json.dumps(one_round()), flush=True)
        llm.shutdown()
        return 0

    if args.against is None:
        llm, one_round = build(args)
        rounds = [one_round() for _ in range(args.rounds)]
        if args.opcodes:
            result["opcodes_per_step"] = count_opcodes(llm, one_round)
        llm.shutdown()
        result["ms_per_step_median"] = medians(rounds)
        result["step_ms_rounds"] = [round(r["step"], 3) for r in rounds]
        emit(result, args.out)
        return 0

    engines = {"this": Engine(BENCHMARKS.parent, args), "against": Engine(args.against, args)}
    rounds: dict[str, list[dict[str, float]]] = {"this": [], "against": []}
    for r in range(args.rounds):
        for name in (("this", "against") if r % 2 == 0 else ("against", "this")):
            rounds[name].append(engines[name].round())
    for engine in engines.values():
        engine.close()
    result["against"] = str(args.against)
    for name, rows in rounds.items():
        result[name] = medians(rows)
    result["this_over_against"] = {
        k: round(statistics.median(a[k] / b[k] for a, b in zip(rounds["this"],
                                                                  rounds["against"])), 3)
        for k in rounds["this"][0] if k != "steps"}
    result["step_ms_rounds"] = {name: [round(r["step"], 3) for r in rows]
                                for name, rows in rounds.items()}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
