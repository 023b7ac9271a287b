"""One prepared GPU check: every GPU-only test and measurement of aserve in one call, each part
under its own time budget, all results in one JSON file plus a human-readable log.

    scripts/gpu_check.sh                          # on the GPU box, ~9.5 min at most
    scripts/gpu_check.sh --sections parity,tp     # a subset, in the usual order
    scripts/gpu_check.sh --device cpu --quick     # the whole script on CPU, tiny shapes

Results go to `$OUT/gpu_check_results.json` when `$OUT` is a folder (`$OUT` itself when it ends
in `.json`; `--out` overrides both), else `./gpu_check_results.json`; the log is
`gpu_check.log` beside it (the sections' own output, then a summary). The JSON is rewritten
after every section, so a killed run keeps what finished. Exit code 1 when any section's status
is not `ok` or `skipped`.

Each section runs in its own Python process (a crash or a hung kernel cannot take the others
down; GPU memory is freed between sections), killed at its budget (seconds, full / quick):

    env              20 /  60  nvidia-smi, python, torch/triton/transformers/... versions,
                               torch's CUDA, the GPUs, the platform aserve picks
    kernel_tests    130 / 240  pytest (-n 8 where pytest-xdist is installed: each test builds
                               its own kernels; on a GPU -k "not cpu_": the C++ CPU kernels'
                               tests are CI's) tests/kernels/test_kernels_{triton,ref}.py,
                               test_sliding_window.py (windows, soft-caps, garbage before
                               the window) and test_attention_sinks.py (gpt-oss sinks vs
                               transformers, split-KV included), then
                               tests/runner/test_graphs.py tests/core (TRITON_INTERPRET unset
                               off CPU): counts of passed/failed/..., the tail of the output
    fused_moe        60 / 240  pytest tests/kernels/test_fused_moe_triton.py (a CUDA-graph
                               capture among them; ~50 kernel builds), then fused_moe_triton vs
                               fused_moe_ref on a Mixtral-ish bf16 layer (T=256, E=8, k=2,
                               H=1024, I=2816; tiny under the CPU interpreter): ms per call, the
                               first call (the build), each one's max error against float32
    quant_gemm       40 / 180  pytest tests/kernels/test_quant_gemm_triton.py, then the Triton
                               W4A16 / W8A16 GEMM (`quant_gemm_triton`) beside F.linear on
                               the same weight in bf16, 4096 x 4096 in groups of 128 (tiny
                               under the CPU interpreter), at 1 and 32 rows: ms per call, the
                               weight bytes each reads, GB/s, the error against the twin
    parity          150 / 300  tiny random llama, qwen3, gemma2 (hybrid: a sliding and a full
                               KV group, soft-caps), mistral (W=7), mixtral, qwen2_moe and
                               gpt_oss (fused MoE; sinks) (tests/helpers/): greedy
                               (logprobs=5) vs HF `generate` on the device. float32: token for
                               token (a mismatch fails; HF runs its eager attention: SDPA may drop a
                               soft-cap); float16 / bfloat16: fraction of tokens
                               equal up to the first divergence, max |logprob diff| of the chosen
                               token, HF's top-2 gap where they diverge; the same for aserve and
                               for HF at that dtype, each against HF float32 (no pass/fail)
    graphs_vs_eager  50 / 180  same models, float32, 24 requests of varied lengths: enforce_eager
                               vs captured decode graphs must give equal tokens (in bf16 they
                               differ by rounding: a padded batch runs other GEMM tiles); graph
                               replays, number of graphs, startup difference (capture time)
    speculative      40 / 150  tiny llama and gemma2 (sliding window), float32, prompts that
                               repeat themselves: greedy with n-gram and with suffix drafts
                               equal to greedy without (a mismatch fails; llama also with
                               itself as its draft model), drafts accepted
                               and rejected, a random-sampled batch with drafts; the drafts
                               and acceptance counted, and the graph replays by rows a
                               request (1: decode; 1 + k: verification steps' own graphs)
    throughput      140 / 300  a random ~1.1B Llama-shaped bf16 model (a 4-layer 256-wide one with
                               --quick) in a temp dir; benchmarks/roofline.py --device (batch-1
                               TPOT against the device's measured read bandwidth: weight bytes
                               per token / GB/s; 16 tokens under torch.profiler: kernel and host
                               time per token, `decode_trace.json` beside the results), then
                               benchmarks/throughput.py --compare-hf, then
                               --no-async-scheduling; their JSON lines and the commands run
    tp               10 / 120  with `tensor_parallel_size` in EngineArgs and >= 2 GPUs (on CPU:
                               2 processes): TP=2 vs TP=1 float32 greedy equality and generate
                               time on a tiny llama; otherwise `skipped` with the reason

Each section is `{"status": ok|fail|error|timeout|skipped, "elapsed_s", "budget_s", "summary",
...}`; `error` carries the traceback, a failing section the tail of its log. `--time-limit`
caps the whole run (560 s, quick 1200 s): a section gets at most what is left of it, and is
`skipped` when under 5 s remain. `--budget NAME=SECONDS` changes one budget; `--throughput-n`
changes throughput's -n (256; 16 with --quick). The ~1.1B model takes 2.2 GB in a temp dir,
removed when the section ends.

HF transformers runs on the same device (`throughput.py --hf-device`). No network is needed:
models are built here, the HF hub is set offline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# name -> (full budget s, quick budget s), in running order
BUDGETS = {
    "env": (20, 60),
    "kernel_tests": (130, 240),
    "fused_moe": (60, 240),
    "quant_gemm": (40, 180),
    "parity": (150, 300),
    "graphs_vs_eager": (50, 180),
    "speculative": (40, 150),
    "throughput": (140, 300),
    "tp": (10, 120),
}
PASSING = ("ok", "skipped")

# ---------------------------------------------------------------- orchestration (no torch here)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), rocm or cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes (for a CPU run)")
    ap.add_argument("--sections", default=",".join(BUDGETS), help="comma-separated subset")
    ap.add_argument("--out", help="results JSON path or folder (default: $OUT, else .)")
    ap.add_argument("--time-limit", type=float, help="seconds for the whole run")
    ap.add_argument("--budget", action="append", default=[], metavar="NAME=SECONDS")
    ap.add_argument("--throughput-n", type=int, help="-n for benchmarks/throughput.py")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section here
    ap.add_argument("--section-out", help=argparse.SUPPRESS)
    ap.add_argument("--section-budget", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(BUDGETS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {', '.join(BUDGETS)}")
    return args


def output_paths(out: str | None) -> tuple[Path, Path]:
    """(results JSON, log) from --out / $OUT: a folder, or a path ending in .json."""
    target = Path(out or os.environ.get("OUT") or ".")
    if target.suffix != ".json":
        target = target / "gpu_check_results.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    name = "gpu_check.log" if target.name == "gpu_check_results.json" else target.stem + ".log"
    return target.resolve(), target.parent.resolve() / name


def section_budgets(args: argparse.Namespace) -> dict[str, float]:
    budgets = {name: float(pair[args.quick]) for name, pair in BUDGETS.items()}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        budgets[name] = float(seconds)
    return budgets


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TQDM_DISABLE="1")  # no bars in the log
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if device != "cpu":
        env.pop("TRITON_INTERPRET", None)  # the kernels must compile for the GPU
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group this script started for one section."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def run_child(name: str, budget: float, args: argparse.Namespace, log_path: Path) -> dict:
    fd, part_name = tempfile.mkstemp(prefix=f"gpu_check_{name}_", suffix=".json")
    os.close(fd)
    part = Path(part_name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--section-out",
           str(part), "--section-budget", str(budget), "--device", args.device]
    cmd += ["--quick"] * args.quick
    cmd += ["--throughput-n", str(args.throughput_n)] if args.throughput_n else []
    offset = log_path.stat().st_size
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=child_env(args.device), start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            rc = None
    result = read_json(part)
    part.unlink()
    part.with_suffix(".tmp").unlink(missing_ok=True)  # a save cut short by the kill
    if rc is None:
        done = [key for key, value in result.items() if isinstance(value, dict)]
        result.update(status="timeout",
                      summary=f"killed at its {budget:.0f} s budget; steps done: {done}")
    elif rc != 0 or "status" not in result:
        result["status"] = "error"
        result.setdefault("error", f"section process exited with code {rc}")
    result.update(elapsed_s=round(time.monotonic() - t0, 1), budget_s=budget)
    if result["status"] not in PASSING:
        result["log_tail"] = log_path.read_text(errors="replace")[offset:][-4000:]
    return result


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError:  # empty: the section process died before its first save
        return {}


def log_line(log_path: Path, text: str) -> None:
    print(text, flush=True)
    with open(log_path, "a") as log:
        log.write(text + "\n")


def orchestrate(args: argparse.Namespace) -> int:
    json_path, log_path = output_paths(args.out)
    log_path.write_text("")
    budgets = section_budgets(args)
    time_limit = args.time_limit or (1200.0 if args.quick else 560.0)
    deadline = time.monotonic() + time_limit
    report: dict = {"script": "scripts/gpu_check.py", "argv": sys.argv[1:],
                    "device": args.device, "quick": args.quick, "time_limit_s": time_limit,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}
    t0 = time.monotonic()
    for name in [s for s in BUDGETS if s in args.sections]:
        budget = min(budgets[name], deadline - time.monotonic())
        log_line(log_path, f"\n===== {name} (budget {budget:.0f} s) =====")
        if budget < 5:
            result = {"status": "skipped", "summary": "no time left under --time-limit"}
        else:
            result = run_child(name, budget, args, log_path)
        report["sections"][name] = result
        report["total_s"] = round(time.monotonic() - t0, 1)
        json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        log_line(log_path, f"----- {name}: {result['status']} in {result.get('elapsed_s', 0)} s"
                           f" -- {result.get('summary', '')}")
    failed = [n for n, r in report["sections"].items() if r["status"] not in PASSING]
    report["status"] = "fail" if failed else "ok"
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    log_line(log_path, f"\n===== {report['status']} in {report['total_s']} s; failed: "
                       f"{failed or 'none'}; results: {json_path}; log: {log_path}")
    return 1 if failed else 0


# ---------------------------------------------------------------- inside one section's process


class Context:
    """One section's state: device, time left, and the result dict, saved after every step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device, self.quick = args.device, args.quick
        self.throughput_n = args.throughput_n
        self.deadline = time.monotonic() + (args.section_budget or 600) - 3
        self.out = Path(args.section_out)
        self.result: dict = {"failures": []}
        self.tmp = tempfile.TemporaryDirectory(prefix="gpu_check_")
        self.root = Path(self.tmp.name)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """Write the result whole, atomically: a kill mid-write leaves the previous one."""
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        os.replace(tmp, self.out)

    def fail(self, reason: str) -> None:
        log(f"FAIL: {reason}")
        self.result["failures"].append(reason)
        self.save()

    def step(self, key: str, fn, *args) -> object:
        """result[key] = fn(*args); an exception is recorded there and fails the section."""
        log(f"-- {key}")
        try:
            value = fn(*args)
        except Exception:
            value = {"error": traceback.format_exc()}
            log(value["error"])
            self.result["status"] = "error"
        self.result[key] = value
        self.save()
        return value

    def finish(self) -> None:
        if self.result.get("status") is None:
            self.result["status"] = "fail" if self.result["failures"] else "ok"
        self.save()


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_divergence(got: list[int], expected: list[int]) -> int:
    """Index of the first differing token; len(expected) when the two are equal."""
    if got == expected:
        return len(expected)
    return next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                min(len(got), len(expected)))


def build_tiny_models(ctx: Context, archs: list[str]) -> dict[str, Path]:
    """The tests' tiny random-weight models (`make_hf_model` defaults, as `model_dir_factory`);
    a name of `SLIDING_CASES` (e.g. gemma2) or `MOE_CASES` (e.g. mixtral) is that test model."""
    from helpers.hf_models import MOE_CASES, SLIDING_CASES, make_hf_model

    def build(name: str) -> Path:
        arch, overrides = {**SLIDING_CASES, **MOE_CASES}.get(name, (name, {}))
        return make_hf_model(ctx.root / name, arch, **overrides)

    return {name: build(name) for name in archs}


def run_llm(model_dir: Path, prompts: list[list[int]], params, **kwargs) -> tuple[list, dict]:
    """aserve's outputs for token-id prompts, and startup / generate times and graph counts."""
    from aserve import LLM

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), **kwargs)
    startup = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        graphs = graphs_of(llm)
        info = {"startup_s": round(startup, 2), "generate_s": round(time.perf_counter() - t0, 2),
                "num_graphs": len(graphs.graphs) if graphs else 0,
                "num_replays": graphs.num_replays if graphs else None}
    finally:  # stop the worker thread (and other ranks); free the device for the next engine
        llm.engine_core.shutdown()
        del llm
        free_memory()
    return outputs, info


def graphs_of(llm):
    """Rank 0's `DecodeGraphs` (None: eager, or a platform without graphs)."""
    runner = getattr(getattr(llm.engine_core.executor, "worker", None), "runner", None)
    return getattr(runner, "graphs", None)


# ---------------------------------------------------------------- env


def section_env(ctx: Context) -> None:
    import importlib.metadata
    import platform

    names = ["torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "pytest",
             "hypothesis", "jinja2", "starlette", "uvicorn", "pydantic", "prometheus-client",
             "huggingface-hub", "accelerate", "ninja", "aserve"]
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    ctx.result.update(python=sys.version, platform=platform.platform(), packages=versions,
                      cpu_count=os.cpu_count(), nvidia_smi=command_text(["nvidia-smi"]))
    ctx.step("torch", torch_facts)
    ctx.step("aserve_platform", aserve_platform)
    ctx.step("kernel_ops", kernel_ops_names)
    gpus = ctx.result["torch"].get("devices", []) if isinstance(ctx.result["torch"], dict) else []
    if ctx.device != "cpu" and not gpus:
        ctx.fail(f"--device {ctx.device} but torch sees no GPU")
    ctx.result["summary"] = (f"torch {versions['torch']}, triton {versions['triton']}, "
                             f"transformers {versions['transformers']}, GPUs: {gpus or 'none'}")


def command_text(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
        return done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cmd[0]} failed: {e!r}"


def torch_facts() -> dict:
    import torch

    facts = {"version": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
             "cuda_available": torch.cuda.is_available(), "devices": []}
    for i in range(torch.cuda.device_count() if facts["cuda_available"] else 0):
        props = torch.cuda.get_device_properties(i)
        facts["devices"].append(f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                                f"sm_{props.major}{props.minor}")
    return facts


def aserve_platform() -> str:
    from aserve.backends import select_platform

    return select_platform("auto").name


def kernel_ops_names() -> dict:
    """Which kernels the auto platform binds per dtype (`Platform.kernel_ops`): op -> function."""
    import torch

    from aserve.backends import select_platform

    platform = select_platform("auto")
    ops_names = ("store_kv", "paged_attention", "attention_forward", "rms_norm", "rope",
                 "silu_and_mul", "argmax", "pack_linears", "decoder_layer", "fused_moe")
    names = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ops = platform.kernel_ops(dtype)
        fns = {op: getattr(ops, op) for op in ops_names}
        names[str(dtype)] = {"name": ops.name, **{
            op: fn and f"{fn.__module__}.{fn.__qualname__}" for op, fn in fns.items()}}
    return names


# ---------------------------------------------------------------- kernel_tests

PYTEST_RUNS = {  # name -> (test paths, share of the time left)
    "kernels": (["tests/kernels/test_kernels_triton.py", "tests/kernels/test_kernels_ref.py",
                 "tests/kernels/test_sliding_window.py", "tests/kernels/test_attention_sinks.py"],
                0.75),
    "graphs_and_unit": (["tests/runner/test_graphs.py", "tests/core"], 1.0),
}


def section_kernel_tests(ctx: Context) -> None:
    for name, (paths, share) in PYTEST_RUNS.items():
        ctx.step(name, run_pytest, ctx, paths, ctx.left() * share)
    ctx.result["summary"] = "; ".join(
        f"{name}: {ctx.result[name].get('counts', 'error')}" for name in PYTEST_RUNS)


def run_pytest(ctx: Context, paths: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors"]  # e.g. hypothesis missing: run the rest
    if ctx.device != "cpu":  # the C++ CPU kernels' tests are CI's (840 here, ~80 s on 8 cores)
        cmd += ["-k", "not cpu_"]
    if ctx.device != "cpu" and importlib.util.find_spec("xdist"):
        cmd += ["-n", "8"]  # H200: test_kernels_triton.py 24.5 s so; serially 90 s ran a quarter
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=REPO, env=child_env(ctx.device), capture_output=True,
                              text=True, timeout=timeout)
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = as_text(e.stdout) + as_text(e.stderr), None
    print(output, flush=True)
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", summary)}
    if rc != 0:
        ctx.fail(f"{' '.join(paths)}: " + ("timed out" if rc is None else f"exit {rc}, {counts}"))
    return {"command": shlex.join(cmd[1:]), "exit_code": rc, "counts": counts,
            "elapsed_s": round(time.monotonic() - t0, 1), "tail": output[-3000:]}


def as_text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


# ---------------------------------------------------------------- fused_moe

MOE_TESTS = ["tests/kernels/test_fused_moe_triton.py"]
MOE_TIMING_RESERVE_S = 25  # of the section's budget, for the timing after the tests
MOE_SHAPES = {  # (T, E, k, H, I): Mixtral-ish on a GPU; tiny under the CPU interpreter
    "cuda": (256, 8, 2, 1024, 2816),
    "cpu": (16, 4, 2, 64, 96),
}


def section_fused_moe(ctx: Context) -> None:
    tests = ctx.step("tests", run_pytest, ctx, MOE_TESTS, ctx.left() - MOE_TIMING_RESERVE_S)
    timing = ctx.step("timing", time_fused_moe, ctx)
    line = "error" if "error" in timing else (
        f"triton {timing['triton']['ms']} ms, ref {timing['ref']['ms']} ms "
        f"(x{timing['speedup']}) at {timing['shape']}")
    ctx.result["summary"] = f"tests: {tests.get('counts', 'error')}; {line}"


def time_fused_moe(ctx: Context) -> dict:
    """fused_moe_triton vs fused_moe_ref on one bf16 layer: ms per call (after a first call,
    which builds the kernels), and each one's max |error| against the float32 reference."""
    if ctx.device == "cpu":  # before aserve.kernels decorates its kernels
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from aserve.kernels.fused_moe_triton import fused_moe_ref, fused_moe_triton
    from aserve.kernels.moe import select_experts

    device = "cpu" if ctx.device == "cpu" else "cuda"
    num_tokens, num_experts, top_k, hidden, inter = MOE_SHAPES[device]
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k,
                                  renormalize=True)
    exact_args = [t.to(device) for t in (x.bfloat16().float(), w13.bfloat16().float(),
                                         w2.bfloat16().float(), weights, ids)]
    args = [t.to(device=device, dtype=torch.bfloat16) for t in (x, w13, w2)] + exact_args[3:]
    exact = fused_moe_ref(*exact_args)
    result = {"shape": dict(T=num_tokens, E=num_experts, k=top_k, H=hidden, I=inter),
              "dtype": "bfloat16", "device": device}
    for name, fn in (("triton", fused_moe_triton), ("ref", fused_moe_ref)):
        result[name] = time_calls(fn, args, 3 if device == "cpu" else 20, device)
        result[name]["max_abs_err_vs_float32"] = (fn(*args).float() - exact).abs().max().item()
    result["speedup"] = round(result["ref"]["ms"] / result["triton"]["ms"], 2)
    step = torch.finfo(torch.bfloat16).eps * exact.abs().max().item()
    triton_err, ref_err = (result[n]["max_abs_err_vs_float32"] for n in ("triton", "ref"))
    if triton_err > 2 * ref_err + step:
        ctx.fail(f"fused_moe_triton max error {triton_err:.3g} vs the reference's {ref_err:.3g}")
    return result


# ---------------------------------------------------------------- quant_gemm

QUANT_TESTS = ["tests/kernels/test_quant_gemm_triton.py"]
QUANT_SHAPES = {"cuda": (4096, 4096, 128), "cpu": (64, 128, 32)}  # (N, K, group)


def section_quant_gemm(ctx: Context) -> None:
    tests = ctx.step("tests", run_pytest, ctx, QUANT_TESTS, ctx.left() - 20)
    timing = ctx.step("timing", time_quant_gemm, ctx)
    line = "error" if "error" in timing else "; ".join(
        f"{k}: {v['ms']} ms" for k, v in timing.items() if isinstance(v, dict) and "ms" in v)
    ctx.result["summary"] = f"tests: {tests.get('counts', 'error')}; {line}"


def time_quant_gemm(ctx: Context) -> dict:
    """W4A16 and W8A16 beside F.linear in bf16 on one weight, at 1 and 32 rows: ms per call,
    bytes of weight read, GB/s, max |error| against the float32 twin."""
    if ctx.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.nn.functional as F

    from aserve.kernels.quant_gemm_triton import TritonQuantWeight, reference
    from aserve.quantization.int_weights import IntWeight

    device = "cpu" if ctx.device == "cpu" else "cuda"
    n, k, group = QUANT_SHAPES[device]
    gen = torch.Generator().manual_seed(0)
    result = {"shape": dict(N=n, K=k, group=group), "device": device}
    for bits in (4, 8):
        q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
        weight = IntWeight(q, torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3,
                           -torch.rand(n, k // group, generator=gen) * 0.05, group, bits)
        packed = TritonQuantWeight(weight, device)
        dense = IntWeight(q, weight.scale.half().float(), weight.min.half().float(), group,
                          bits).dequantize().to(device=device, dtype=torch.bfloat16)
        stored = packed.q.numel() + 2 * packed.scale.numel() * 2
        for rows in (1, 32):
            x = torch.randn(rows, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            for name, fn, nbytes in ((f"w{bits}a16_m{rows}", packed.linear, stored),
                                     (f"bf16_m{rows}", lambda x, w=dense: F.linear(x, w),
                                      dense.numel() * 2)):
                if name in result:
                    continue
                timing = time_calls(fn, [x], 3 if device == "cpu" else 50, device)
                timing["gb_s"] = round(nbytes / (timing["ms"] / 1e3) / 1e9, 1)
                timing["max_abs_err"] = (fn(x).float().cpu() - reference(x.cpu(), weight)
                                         ).abs().max().item()
                result[name] = timing
    return result


def time_calls(fn, args: list, iters: int, device: str) -> dict:
    """The first call's seconds, then ms per call over `iters` calls (synchronised)."""
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    fn(*args)
    sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    sync()
    return {"first_call_s": round(first, 3),
            "ms": round((time.perf_counter() - t0) / iters * 1e3, 3), "iters": iters}


# ---------------------------------------------------------------- parity

PROMPT_LENS = [3, 7, 16, 17, 31, 40, 55, 64]  # as tests/models/test_parity.py
NUM_NEW = 32
DTYPES = ["float32", "float16", "bfloat16"]
# gemma2: a hybrid cache (a sliding and a full group), soft-caps; mistral: every layer W=7;
# mixtral / qwen2_moe / gpt_oss: the fused-MoE Triton kernel inside a model (qwen2_moe: a
# shared expert; gpt_oss: attention sinks, biased clamped experts, YaRN)
PARITY_MODELS = ["llama", "qwen3", "gemma2", "mistral", "mixtral", "qwen2_moe", "gpt_oss"]


def section_parity(ctx: Context) -> None:
    lines = []
    for arch, model_dir in build_tiny_models(ctx, PARITY_MODELS).items():
        prompts, references = parity_prompts(model_dir), {}
        for dtype in DTYPES:
            r = ctx.step(f"{arch}/{dtype}", parity_one, ctx, model_dir, prompts, dtype,
                         references)
            lines.append(f"{arch}/{dtype} {parity_line(r)}")
    ctx.result["summary"] = "; ".join(lines)


def parity_line(r: dict) -> str:
    if "error" in r:
        return "error"
    line = (f"{r['num_equal']}/{r['num_prompts']} equal, "
            f"max dlogprob {r['max_abs_logprob_diff']:.2g}")
    if "vs_hf_float32" in r:
        line += (f" (vs HF float32: aserve {r['vs_hf_float32']['max_abs_logprob_diff']:.2g}, "
                 f"HF {r['hf_vs_hf_float32']['max_abs_logprob_diff']:.2g})")
    return line


def parity_prompts(model_dir: Path) -> list[list[int]]:
    import random

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def parity_one(ctx: Context, model_dir: Path, prompts: list[list[int]], dtype: str,
               references: dict) -> dict:
    """aserve vs HF at `dtype`; at float16/bfloat16 also aserve and HF each vs HF float32
    (`references` keeps HF's runs per dtype)."""
    from aserve import SamplingParams

    for key in dict.fromkeys(["float32", dtype]):
        if key not in references:
            references[key] = hf_greedy(model_dir, key, ctx.device, prompts)
    # min_tokens masks EOS until max_tokens, as HF's min_new_tokens does (where a model's
    # argmax is EOS both take the runner-up; ignore_eos would keep EOS)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=5)
    outputs, info = run_llm(model_dir, prompts, params, dtype=dtype, device=ctx.device)
    chosen = aserve_chosen(outputs)
    result = {**compare_greedy(*chosen, *references[dtype]), "aserve": info}
    if dtype != "float32":
        result["vs_hf_float32"] = compare_greedy(*chosen, *references["float32"])
        result["hf_vs_hf_float32"] = compare_greedy(*hf_chosen(*references[dtype]),
                                                    *references["float32"])
    elif result["num_equal"] != result["num_prompts"]:
        ctx.fail(f"{model_dir.name}/float32: greedy tokens differ from HF: "
                 f"{result['divergences']}")
    return result


def hf_greedy(model_dir: Path, dtype: str, device: str, prompts: list[list[int]]):
    """HF's greedy continuations and raw logits ([NUM_NEW, vocab] float32, CPU) per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    from helpers.hf_models import HF_ATTENTION  # eager: SDPA may drop a soft-cap

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype,
                                                 attn_implementation=HF_ATTENTION)
    model = model.to(device=device, dtype=torch_dtype).eval()  # older transformers: torch_dtype
    ids_out, logits_out = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            ids_out.append(out.sequences[0, len(prompt):].tolist())
            logits_out.append(torch.cat(out.logits).float().cpu())
    del model
    free_memory()
    return ids_out, logits_out


def aserve_chosen(outputs: list) -> tuple[list[list[int]], list[list[float]]]:
    """Each completion's tokens and the logprob aserve gave each."""
    completions = [o.outputs[0] for o in outputs]
    return ([c.token_ids for c in completions],
            [[entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
             for c in completions])


def hf_chosen(ids: list[list[int]], logits: list) -> tuple[list[list[int]], list[list[float]]]:
    """HF's tokens and their logprobs, from its raw logits."""
    import torch

    return ids, [torch.log_softmax(lg, dim=-1)[torch.arange(len(t)), t].tolist()
                 for t, lg in zip(ids, logits)]


def compare_greedy(ids: list[list[int]], logprobs: list[list[float]], ref_ids: list[list[int]],
                   ref_logits: list) -> dict:
    """Tokens equal up to the first divergence from the reference, and |logprob diff| of the
    chosen token at every step up to and including it (the contexts are the same there)."""
    import torch

    matched, diffs, divergences = 0, [], []
    for i, (got, got_lp, expected, logits) in enumerate(zip(ids, logprobs, ref_ids, ref_logits)):
        step = first_divergence(got, expected)
        matched += step
        ref_lp = torch.log_softmax(logits, dim=-1)  # [NUM_NEW, vocab]
        diffs += [abs(got_lp[s] - ref_lp[s, got[s]].item())
                  for s in range(min(step + 1, len(got), len(ref_lp)))]
        if step < len(expected):
            top2 = ref_lp[step].topk(2).values.tolist()
            divergences.append({"prompt": i, "step": step, "ref_top2_gap": round(
                top2[0] - top2[1], 5), "got": got[step:step + 3], "ref": expected[step:step + 3]})
    return {"num_prompts": len(ids), "num_equal": len(ids) - len(divergences),
            "matched_prefix_fraction": round(matched / sum(map(len, ref_ids)), 4),
            "max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "divergences": divergences}


# ---------------------------------------------------------------- graphs_vs_eager


def section_graphs_vs_eager(ctx: Context) -> None:
    lines = []
    for arch, model_dir in build_tiny_models(ctx, PARITY_MODELS).items():
        r = ctx.step(arch, graphs_one, ctx, model_dir)
        lines.append(f"{arch}: " + (f"{r['num_equal']}/{r['num_prompts']} equal, "
                                    f"{r['graphs']['num_replays']} replays, capture "
                                    f"{r['capture_s']} s" if "error" not in r else "error"))
    ctx.result["summary"] = "; ".join(lines)


def graphs_one(ctx: Context, model_dir: Path) -> dict:
    import random

    from aserve import SamplingParams

    rng = random.Random(1)
    lengths = [1, 15, 16, 17, 33, 250] + [rng.randrange(2, 200) for _ in range(18)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 80), ignore_eos=True)
              for _ in prompts]
    # float32: in bf16 the two differ by rounding alone (a padded graph batch runs other GEMM
    # tiles; seen on the H200: llama bf16 14/24 equal, float32 24/24)
    kwargs = {"dtype": "float32", "device": ctx.device}
    eager, eager_info = run_llm(model_dir, prompts, params, enforce_eager=True, **kwargs)
    graphed, graph_info = run_llm(model_dir, prompts, params, **kwargs)
    mismatches = [{"prompt": i, "len": len(p), "step": first_divergence(
        g.outputs[0].token_ids, e.outputs[0].token_ids)}
        for i, (p, e, g) in enumerate(zip(prompts, eager, graphed))
        if g.outputs[0].token_ids != e.outputs[0].token_ids]
    if mismatches:
        ctx.fail(f"{model_dir.name}: graphs differ from eager: {mismatches}")
    if ctx.device != "cpu" and not graph_info["num_replays"]:
        ctx.fail(f"{model_dir.name}: no decode step replayed a graph")
    return {"num_prompts": len(prompts), "num_equal": len(prompts) - len(mismatches),
            "mismatches": mismatches, "eager": eager_info, "graphs": graph_info,
            "capture_s": round(graph_info["startup_s"] - eager_info["startup_s"], 2),
            "note": "capture_s = startup with graphs - startup with enforce_eager"}


# ---------------------------------------------------------------- speculative decoding


def section_speculative(ctx: Context) -> None:
    lines = []
    for arch, model_dir in build_tiny_models(ctx, ["llama", "gemma2"]).items():
        r = ctx.step(arch, speculative_one, ctx, model_dir)
        lines.append(f"{arch}: " + ("error" if "error" in r else ", ".join(
            f"{m} {v['num_equal']}/{v['num_prompts']} equal, {v['accepted']}/{v['drafted']} "
            "drafts accepted" for m, v in r.items())))
    ctx.result["summary"] = "; ".join(lines)


def speculative_one(ctx: Context, model_dir: Path) -> dict:
    import random

    from aserve import SamplingParams

    rng = random.Random(2)
    prompts = []
    for n in (5, 9, 14, 21, 40):
        run = [rng.randrange(3, 500) for _ in range(n)]
        prompts.append(run + run[: max(2, n // 2)])
    prompts.append([100, 200, 300] * 4)  # the tiny llama's reply to it repeats itself
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    kwargs = {"dtype": "float32", "device": ctx.device}
    plain, _ = run_llm(model_dir, prompts, params, **kwargs)
    out = {}
    methods = [("ngram", {"method": "ngram", "num_speculative_tokens": 4,
                          "prompt_lookup_min": 1}),
               ("suffix", {"method": "suffix", "num_speculative_tokens": 8})]
    if "gemma" not in model_dir.name:  # (a draft model of full-attention layers only)
        methods.append(("draft_model", {"method": "draft_model", "model": str(model_dir),
                                        "num_speculative_tokens": 3}))
    for method, config in methods:
        from aserve import LLM

        with LLM(str(model_dir), speculative_config=config, **kwargs) as llm:
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32))
            stats = llm.stats()
            graphs = graphs_of(llm)  # verification steps of 1 + k rows a request replayed
            replays = {str(q): n for q, n in graphs.replays.items()} if graphs else None
        mismatches = [i for i, (a, b) in enumerate(zip(plain, got))
                      if a.outputs[0].token_ids != b.outputs[0].token_ids]
        if mismatches:
            ctx.fail(f"{model_dir.name} {method}: drafts changed greedy output: {mismatches}")
        if not stats.spec_decode_num_accepted_tokens:
            ctx.fail(f"{model_dir.name} {method}: no draft accepted")
        out[method] = {"num_prompts": len(prompts), "num_equal": len(prompts) - len(mismatches),
                       "drafted": stats.spec_decode_num_draft_tokens,
                       "accepted": stats.spec_decode_num_accepted_tokens,
                       "per_position": list(stats.spec_decode_num_accepted_tokens_per_pos),
                       "graph_replays_by_rows_a_request": replays}
        free_memory()
    return out


# ---------------------------------------------------------------- throughput

BENCH_SHAPES = {  # ~1.1B parameters full; a small one for --quick
    False: dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=8192, vocab_size=32000),
    True: dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, intermediate_size=1024, vocab_size=32000),
}
BENCH_RUNS = {  # (-n, -i, -o, --hf-batch-size) full / quick
    False: (256, 512, 128, 64),
    True: (16, 64, 16, 8),
}


def section_throughput(ctx: Context) -> None:
    model_dir = ctx.root / "bench-model"
    ctx.step("model", build_bench_model, model_dir, BENCH_SHAPES[ctx.quick], ctx.device)
    n, i, o, hf_batch = BENCH_RUNS[ctx.quick]
    n = ctx.throughput_n or n
    base = ["--model", str(model_dir), "--dtype", "bfloat16", "-n", str(n), "-i", str(i),
            "-o", str(o)]
    out = os.environ.get("OUT", "")  # a folder: the decode trace goes beside the results
    trace = ["--trace", str(Path(out) / "decode_trace.json")] if Path(out).is_dir() else []
    batch1 = ctx.step("batch1_roofline", run_benchmark, ctx,
                      ["--model", str(model_dir), "--device", ctx.device, "-i", "16", "-o",
                       str(o), "--buffer-gib", "0.25" if ctx.quick else "4", "--profile", "16",
                       *trace], 100, "benchmarks/roofline.py")
    first = ctx.step("async_vs_hf", run_benchmark, ctx,
                     base + ["--compare-hf", "--hf-batch-size", str(hf_batch)], 45)
    second = ctx.step("sync", run_benchmark, ctx, base + ["--no-async-scheduling"], 0)
    ctx.result["summary"] = ", ".join(
        f"{key} {value}" for key, value in (
            ("aserve tok/s", dig(first, "aserve", "output_tokens_per_s")),
            ("hf tok/s", dig(first, "hf", "output_tokens_per_s")),
            ("ratio_vs_hf", dig(first, "ratio_vs_hf")),
            ("aserve sync tok/s", dig(second, "aserve", "output_tokens_per_s")),
            ("batch-1 TPOT ms", dig(batch1, "aserve", "tpot_ms")),
            ("roofline TPOT ms", dig(batch1, "roofline_tpot_ms")),
            ("fraction of roofline", dig(batch1, "aserve", "fraction_of_roofline")),
            ("kernels ms/token", dig(batch1, "aserve", "profile", "device_kernels_ms_per_token"))))


def dig(value, *keys):
    for key in ("result", *keys):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def build_bench_model(out: Path, shape: dict, device: str) -> dict:
    """A random-weight bf16 Llama (safetensors), a tokenizer and a generation config."""
    import torch
    import transformers
    from helpers.hf_models import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    t0 = time.perf_counter()
    config = transformers.LlamaConfig(**shape, max_position_embeddings=2048, rms_norm_eps=1e-5,
                                      bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                      pad_token_id=PAD_ID, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    free_memory()
    build_tokenizer(out, vocab_size=shape["vocab_size"])
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen) + "\n")
    return {**shape, "num_params": num_params, "dtype": "bfloat16",
            "build_s": round(time.perf_counter() - t0, 1)}


def run_benchmark(ctx: Context, bench_args: list[str], reserve_s: float,
                  script: str = "benchmarks/throughput.py") -> dict:
    """`script` with these arguments, leaving `reserve_s` of the budget."""
    timeout = ctx.left() - reserve_s
    if timeout < 20:
        ctx.fail(f"{script} {shlex.join(bench_args[2:])} not run: {timeout:.0f} s left")
        return {"skipped": f"only {timeout:.0f} s of the budget left"}
    cmd = [sys.executable, script, *bench_args]
    if "--compare-hf" in bench_args:
        cmd += ["--hf-device", ctx.device]
    log("$ " + shlex.join(cmd))
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=child_env(ctx.device), capture_output=True,
                          text=True, timeout=timeout)
    print(done.stdout + done.stderr, flush=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-2000:]}")
    return {"command": shlex.join(["python", *cmd[1:]]), "exit_code": done.returncode,
            "elapsed_s": round(time.monotonic() - t0, 1),
            "result": json.loads(lines[-1])}


# ---------------------------------------------------------------- tp


def section_tp(ctx: Context) -> None:
    import torch

    from aserve.engine.arg_utils import EngineArgs

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has_tp = "tensor_parallel_size" in EngineArgs.__dataclass_fields__
    ctx.result.update(num_gpus=num_gpus, engine_args_has_tensor_parallel_size=has_tp)
    if ctx.device != "cpu" and num_gpus < 2:
        reason = f"needs >= 2 GPUs, found {num_gpus}"
    elif not has_tp:
        reason = "needs tensor parallelism (issue 7)"
    else:
        r = ctx.step("llama", tp_one, ctx, build_tiny_models(ctx, ["llama"])["llama"])
        ctx.result["summary"] = (f"TP=2 vs TP=1: {r['num_equal']}/{r['num_prompts']} equal"
                                 if "error" not in r else "error")
        return
    ctx.result.update(status="skipped", summary=f"skipped: {reason}")


def tp_one(ctx: Context, model_dir: Path) -> dict:
    """float32 greedy with the model split over 2 ranks equals 1 rank (GPUs: one per rank;
    CPU: two processes), and the time each took to generate."""
    import random

    from aserve import SamplingParams

    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS * 4]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    kwargs = {"dtype": "float32", "device": ctx.device}
    one, one_info = run_llm(model_dir, prompts, params, tensor_parallel_size=1, **kwargs)
    two, two_info = run_llm(model_dir, prompts, params, tensor_parallel_size=2, **kwargs)
    unequal = [i for i, (a, b) in enumerate(zip(one, two))
               if a.outputs[0].token_ids != b.outputs[0].token_ids]
    if unequal:
        ctx.fail(f"TP=2 differs from TP=1 on prompts {unequal}")
    return {"num_prompts": len(prompts), "num_equal": len(prompts) - len(unequal),
            "tp1": one_info, "tp2": two_info}


# ---------------------------------------------------------------- entry points

SECTIONS = {"env": section_env, "kernel_tests": section_kernel_tests,
            "fused_moe": section_fused_moe, "quant_gemm": section_quant_gemm,
            "parity": section_parity,
            "graphs_vs_eager": section_graphs_vs_eager,
            "speculative": section_speculative, "throughput": section_throughput,
            "tp": section_tp}


def run_section(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally`s: temp dirs go
    ctx = Context(args)
    ctx.save()
    try:
        SECTIONS[args.section](ctx)
    except Exception:
        ctx.result.update(status="error", error=traceback.format_exc())
        log(ctx.result["error"])
    finally:
        ctx.finish()
        ctx.tmp.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return run_section(args) if args.section else orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
