"""Structured outputs (issue 18): what a JSON-schema constraint costs a served model, and what
compiling a schema and filling its token masks cost. Prints one JSON line (progress to stderr).

    python benchmarks/structured_outputs.py --model /tmp/models/smol [--rounds 2] \\
        [--concurrency 32] [-n 128] [--out FILE] [--quick]

Served: one `python -m aserve` (compare.py's `Server`, prefix caching off so that every workload
prefills its prompts), driven by serve.py's client at a fixed concurrency over
`/v1/completions` (seeded random prompt ids, greedy, streamed), three workloads of the same
prompts, their order rotated over --rounds (round r starts at workload r mod 3):

    constrained     every request `response_format` json_schema (structured_grammar.SCHEMA:
                    an order, nine typed properties), max_tokens --max-tokens; it ends where
                    its JSON does (the grammar then allows only EOS)
    unconstrained   no constraint, `ignore_eos`, max_tokens = what the same prompt's
                    constrained request generated in the calibration pass
    mix             even requests as in constrained, odd ones as in unconstrained

The calibration pass (the constrained workload once, before the rounds; it also warms the
server up and fills its grammar cache) fixes every prompt's output length, so the three
workloads generate the same number of tokens per request in schedules of the same shape
(greedy outputs repeat; the tokens are reported, and throughput is per token). Every constrained
output is checked with `jsonschema`; a reply cut at max_tokens counts as invalid. The best
round per workload counts (noise only ever slows a run down); ratios are over unconstrained.

Grammar (in this process, after the server stopped): structured_grammar.grammar_timings on the
model's tokenizer, a large schema of --large-properties properties and --concurrency rows.

--quick: a tiny llama from tests/helpers (float32), 8 requests, one round (what the test runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import serve  # noqa: E402
from common import emit, free_port, summarize_ms, vocab_size_of  # noqa: E402
from compare import Server, begin, loadavg, log, resolve_paths, rotated, server_command  # noqa: E402
from structured_grammar import SCHEMA, grammar_timings  # noqa: E402

RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}
WORKLOADS = ("constrained", "unconstrained", "mix")
SERVE_FIELDS = ("num_prompts", "completed", "failed", "errors", "duration_s", "output_tokens",
                "output_tokens_per_s", "request_throughput", "ttft_ms", "tpot_ms", "itl_ms",
                "e2e_ms")
QUICK = dict(num_prompts=8, concurrency=4, input_len=16, max_tokens=400, rounds=1,
             dtype="float32", request_timeout=300.0)
DEFAULT_MODEL = "/tmp/models/smol"


def is_constrained(workload: str, index: int) -> bool:
    return workload == "constrained" or (workload == "mix" and index % 2 == 0)


# ---------------------------------------------------------------------------------- served

def request_body(workload: str, model: str, spec: serve.RequestSpec, index: int,
                 lengths: list[int] | None, max_tokens: int) -> dict:
    if is_constrained(workload, index):
        return {**serve.request_body(model, spec.prompt, max_tokens), "ignore_eos": False,
                "response_format": RESPONSE_FORMAT}
    return serve.request_body(model, spec.prompt, lengths[index])


def validate(records: list[serve.RequestRecord]) -> dict:
    """How many of these constrained replies are JSON that validates against SCHEMA."""
    import jsonschema

    errors = []
    for r in records:
        try:
            jsonschema.validate(json.loads(r.text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            errors.append(f"request {r.index} ({r.finish_reason}): {str(e).splitlines()[0]}")
    finish = {}
    for r in records:
        finish[str(r.finish_reason)] = finish.get(str(r.finish_reason), 0) + 1
    return {"num_checked": len(records), "num_valid": len(records) - len(errors),
            "finish_reasons": finish, "errors": errors[:3]}


def workload_report(sargs: argparse.Namespace, model: str, workload: str,
                    records: list[serve.RequestRecord], duration: float,
                    lengths: list[int] | None) -> dict:
    summary = serve.summarize(sargs, model, records, duration)
    report = {k: summary[k] for k in SERVE_FIELDS}
    mine = [r for r in records if r.ok and is_constrained(workload, r.index)]
    free = [r for r in records if r.ok and not is_constrained(workload, r.index)]
    report.update(num_constrained=len(mine), validation=validate(mine),
                  output_tokens_constrained=sum(r.output_tokens for r in mine),
                  output_tokens_unconstrained=sum(r.output_tokens for r in free))
    if lengths is not None:  # unconstrained rows made exactly the calibrated lengths
        report["num_unconstrained_at_length"] = sum(r.output_tokens == lengths[r.index]
                                                    for r in free)
    if workload == "mix":
        report["tpot_ms_by_kind"] = {
            kind: summarize_ms(r.tpot_s for r in rows if r.tpot_s is not None)
            for kind, rows in (("constrained", mine), ("unconstrained", free))}
    return report


async def run_workload(client: httpx.AsyncClient, sargs: argparse.Namespace, model: str,
                       specs: list[serve.RequestSpec], workload: str,
                       lengths: list[int] | None, max_tokens: int
                       ) -> tuple[dict, list[serve.RequestRecord]]:
    body_of = lambda i: request_body(workload, model, specs[i], i, lengths, max_tokens)
    records, duration = await serve.run_all(client, sargs, model, specs, body_of)
    return workload_report(sargs, model, workload, records, duration, lengths), records


async def drive(args: argparse.Namespace, url: str) -> dict:
    """The calibration pass, then every workload in every round (order rotated)."""
    sargs = serve.build_parser().parse_args(
        ["--base-url", url, "-n", str(args.num_prompts), "-i", str(args.input_len),
         "-o", str(args.max_tokens), "--concurrency", str(args.concurrency),
         "--timeout", str(args.request_timeout), "--seed", str(args.seed)])
    limits = httpx.Limits(max_connections=args.concurrency,
                          max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout),
                                 limits=limits) as client:
        model = await serve.served_model_name(client)
        specs = serve.build_requests(sargs, vocab_size_of(args.model), None)
        log("calibration: the constrained workload once")
        calibration, records = await run_workload(client, sargs, model, specs, "constrained",
                                                  None, args.max_tokens)
        lengths = [r.output_tokens or args.max_tokens for r in records]
        rounds: dict[str, list[dict]] = {w: [] for w in WORKLOADS}
        for r in range(args.rounds):
            for workload in rotated(list(WORKLOADS), r):
                load = loadavg()
                report, _ = await run_workload(client, sargs, model, specs, workload, lengths,
                                               args.max_tokens)
                rounds[workload].append({**report, "loadavg_1m": load})
                log(f"round {r} {workload}: {report['output_tokens_per_s']} out tok/s, TPOT p50 "
                    f"{report['tpot_ms']['p50']} ms, {report['validation']['num_valid']}/"
                    f"{report['num_constrained']} valid")
    return {"calibration": {k: calibration[k] for k in
                            ("output_tokens", "output_tokens_per_s", "validation")},
            "output_lengths": summarize_lengths(lengths), **aggregate(rounds)}


def summarize_lengths(lengths: list[int]) -> dict:
    return {"total": sum(lengths), "min": min(lengths), "max": max(lengths),
            "mean": round(sum(lengths) / len(lengths), 1)}


def aggregate(rounds: dict[str, list[dict]]) -> dict:
    """The best round per workload (highest output tok/s), and the ratios over unconstrained:
    output tok/s (higher is better), TPOT and TTFT p50 (lower is better)."""
    workloads = {}
    for name, runs in rounds.items():
        best = max(runs, key=lambda x: x["output_tokens_per_s"])
        workloads[name] = {**{k: v for k, v in best.items() if k != "loadavg_1m"},
                           "rounds_output_tokens_per_s": [x["output_tokens_per_s"] for x in runs],
                           "rounds_loadavg_1m": [x["loadavg_1m"] for x in runs]}

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    base = workloads["unconstrained"]
    ratios = {f"{name}_over_unconstrained": {
        "output_tokens_per_s": ratio(w["output_tokens_per_s"], base["output_tokens_per_s"]),
        "tpot_p50": ratio(w["tpot_ms"]["p50"], base["tpot_ms"]["p50"]),
        "ttft_p50": ratio(w["ttft_ms"]["p50"], base["ttft_ms"]["p50"])}
        for name, w in workloads.items() if name != "unconstrained"}
    goal = ratios["constrained_over_unconstrained"]["output_tokens_per_s"]
    return {"workloads": workloads, "ratios": ratios,
            "goal": "constrained / unconstrained output tok/s >= 0.9",
            "goal_met": goal is not None and goal >= 0.9}


def run_served(args: argparse.Namespace) -> dict:
    port = free_port()
    server = Server(server_command(args, "aserve", port), dict(os.environ),
                    args.workdir / "aserve.log", port)
    try:
        ready = server.wait_ready(args.ready_timeout)
        log(f"aserve ready in {ready:.1f} s")
        return {"readiness_s": round(ready, 2), "concurrency": args.concurrency,
                "num_prompts": args.num_prompts, "input_len": args.input_len,
                "max_tokens": args.max_tokens, **asyncio.run(drive(args, server.url))}
    finally:
        server.stop()


# ---------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="HF model directory (default: /tmp/models/smol; with --quick a tiny "
                         "llama built in the work folder)")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model, 8 requests, one round (flags given still win)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--num-prompts", type=int, default=128, help="requests per workload")
    ap.add_argument("-i", "--input-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=512,
                    help="constrained requests' max_tokens (their JSON ends first)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--large-properties", type=int, default=120)
    ap.add_argument("--cold-variants", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aserve-args", default="--no-enable-prefix-caching",
                    help="extra `python -m aserve` flags (default: prefix caching off, so "
                         "that every workload prefills the same prompts)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="the server's log (and the --quick model; default: a temporary dir)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=900.0, help="per workload")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if "--quick" in argv:
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="aserve-structured-"))
    if args.model is None:
        args.model = args.workdir / "tiny-llama" if args.quick else DEFAULT_MODEL
    resolve_paths(args, "aserve-structured-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick and not (Path(args.model) / "config.json").exists():
        from tests.helpers.hf_models import make_hf_model

        make_hf_model(args.model, "llama")
    result = begin(args, "structured_outputs", "best round per workload")
    t0 = time.perf_counter()
    result["serve"] = run_served(args)
    log("grammar timings")
    result["grammar"] = grammar_timings(args.model, args.concurrency, args.large_properties,
                                        args.cold_variants, args.seed)
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
