"""Disaggregated prefill (issue 20): one instance against a prefill instance + a decode instance
behind `python -m aserve.disagg_proxy`, on a mixed workload, in one invocation. Prints one JSON
line (progress to stderr).

    python benchmarks/disagg.py --model DIR [--connector SharedStorageConnector|P2pConnector]
        [--rounds 2] [--quick]

Workload: short requests (--short-input in / --short-output out, streamed, --short-concurrency
at a time) decode while long prompts (--long-input in / --long-output out) arrive one every
--long-interval seconds. Reported per setup (the median over rounds, setups alternating): the
short requests' TTFT p50, TPOT p50 and inter-token p99 (what a long prefill does to the users
already decoding), the long requests' TTFT p50, output tokens/s, and for the disaggregated
setup the transfer: bytes, seconds, seconds per KV block (from the instances' `/metrics`), and
the share of the decode side's prompt tokens it loaded instead of computing.

What this machine can show: with --split-cores (the default) the prefill instance runs on one
core and the decode instance on the other (`taskset`, one OpenMP thread each), against one
instance on both: the same silicon, split by phase, so a long prefill no longer sits in the
decodes' steps, while each phase has half the compute. Without it both instances' OpenMP
threads contend for both cores (each spins at its barriers while the other runs), which says
nothing about disaggregation. The transfer is a copy through the page cache or loopback, not a
network. What it cannot show: separate machines, or a decode instance sized for its phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
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
from common import emit, free_port, make_prompts, parse_prometheus, percentile, vocab_size_of  # noqa: E402
from compare import Server, loadavg, log, rotated  # noqa: E402

SETUPS = ["single", "disagg"]


def kv_bytes_per_block(model_dir: str, block_size: int, dtype: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    itemsize = 4 if dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * block_size * itemsize


def aserve_command(args: argparse.Namespace, port: int, kv_config: dict | None) -> list[str]:
    cmd = [sys.executable, "-m", "aserve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--block-size", str(args.block_size),
           "--served-model-name", "bench", *args.aserve_args.split()]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    return cmd


def kv_configs(args: argparse.Namespace, store: Path) -> tuple[dict, dict]:
    """P2P: the consumer pulls only from this producer (`producers`); their shared secret
    goes in the environment (`start_setup`)."""
    if args.connector == "P2pConnector":
        port = free_port()
        return ({"kv_connector": args.connector, "kv_role": "kv_producer",
                 "kv_ip": "127.0.0.1", "kv_port": port},
                {"kv_connector": args.connector, "kv_role": "kv_consumer",
                 "kv_ip": "127.0.0.1", "kv_port": free_port(),
                 "kv_connector_extra_config": {"producers": [f"127.0.0.1:{port}"]}})
    extra = {"shared_storage_path": str(store)}
    return tuple({"kv_connector": args.connector, "kv_role": role,
                  "kv_connector_extra_config": extra} for role in ("kv_producer", "kv_consumer"))


def split_cores() -> tuple[list[int], list[int]]:
    """This process' cores in two halves: the prefill instance's and the decode instance's."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--split-cores needs at least 2 cores")
    half = len(cores) // 2
    return cores[:half], cores[half:]


def start_setup(args: argparse.Namespace, setup: str, r: int, workdir: Path) -> tuple[
        str, list[Server], list[str]]:
    """(the URL clients use, the processes, the aserve instances' URLs)."""
    if setup == "single":
        port = free_port()
        server = Server(aserve_command(args, port, None), dict(os.environ),
                        workdir / f"single_r{r}.log", port)
        server.wait_ready(args.ready_timeout)
        return server.url, [server], [server.url]
    produce, consume = kv_configs(args, workdir / f"store_r{r}")
    servers = []
    cores = split_cores() if args.split_cores else None
    secret = secrets.token_hex(32)  # P2P: shared by the two instances, out of `ps`
    for i, (role, config) in enumerate((("prefill", produce), ("decode", consume))):
        port = free_port()
        cmd = aserve_command(args, port, config)
        env = {**os.environ, "ASERVE_KV_SECRET": secret}
        if cores is not None:  # each phase on its own cores, one OpenMP thread per core
            cmd = ["taskset", "-c", ",".join(map(str, cores[i])), *cmd]
            env["OMP_NUM_THREADS"] = str(len(cores[i]))
        servers.append(Server(cmd, env, workdir / f"{role}_r{r}.log", port))
    for server in servers:
        server.wait_ready(args.ready_timeout)
    port = free_port()
    proxy = Server([sys.executable, "-m", "aserve.disagg_proxy", "--prefill", servers[0].url,
                    "--decode", servers[1].url, "--port", str(port)], dict(os.environ),
                   workdir / f"proxy_r{r}.log", port)
    proxy.wait_ready(args.ready_timeout)
    return proxy.url, [*servers, proxy], [s.url for s in servers]


async def drive(args: argparse.Namespace, url: str) -> tuple[list, list, float]:
    """Short requests at their concurrency while long ones arrive on a clock; returns (short
    records, long records, seconds)."""
    vocab = vocab_size_of(args.model)
    shorts = make_prompts(args.short_requests, args.short_input, vocab, seed=1)
    longs = make_prompts(args.long_requests, args.long_input, vocab, seed=2)
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout,
                                 limits=limits) as client:
        queue = list(enumerate(shorts))

        async def short_worker(out: list) -> None:
            while queue:
                _, prompt = queue.pop(0)
                record = serve.RequestRecord(index=len(out))
                out.append(await serve.send(client, "/v1/completions", serve.request_body(
                    "bench", prompt, args.short_output), record))

        async def long_arrivals(out: list) -> None:
            pending = []
            for i, prompt in enumerate(longs):
                await asyncio.sleep(args.long_interval if i else args.long_delay)
                record = serve.RequestRecord(index=i)
                out.append(record)
                pending.append(asyncio.create_task(serve.send(
                    client, "/v1/completions",
                    serve.request_body("bench", prompt, args.long_output), record)))
            await asyncio.gather(*pending)

        short_records, long_records = [], []
        t0 = time.perf_counter()
        await asyncio.gather(long_arrivals(long_records),
                             *(short_worker(short_records)
                               for _ in range(args.short_concurrency)))
        return short_records, long_records, time.perf_counter() - t0


def ms(values: list[float], q: float) -> float | None:
    return round(1000 * percentile(sorted(values), q), 2) if values else None


def figures(shorts: list, longs: list, seconds: float) -> dict:
    failed = [r.error for r in shorts + longs if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0]}")
    itls = [x for r in shorts for x in r.itl_s]
    out_tokens = sum(r.output_tokens for r in shorts + longs)
    return {
        "short_ttft_p50_ms": ms([r.ttft_s for r in shorts], 50),
        "short_tpot_p50_ms": ms([r.tpot_s for r in shorts if r.tpot_s is not None], 50),
        "short_itl_p99_ms": ms(itls, 99),
        "long_ttft_p50_ms": ms([r.ttft_s for r in longs], 50),
        "output_tok_s": round(out_tokens / seconds, 1),
        "seconds": round(seconds, 2),
    }


def transfer_figures(args: argparse.Namespace, instance_urls: list[str]) -> dict:
    """The connector's counters on each side (bytes and seconds moved; the decode side's
    prompt tokens asked of / loaded from it; failed loads)."""
    out = {}
    per_block = kv_bytes_per_block(args.model, args.block_size, args.dtype)
    for role, url in zip(("prefill", "decode"), instance_urls):
        metrics = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
        total = lambda name, m=metrics: m.get(f"aserve:{name}", 0.0)  # noqa: E731
        moved, seconds = total("kv_transfer_bytes_total"), total("kv_transfer_seconds_total")
        blocks = moved / per_block
        out[role] = {"bytes": int(moved), "seconds": round(seconds, 4),
                     "ms_per_block": round(1000 * seconds / blocks, 4) if blocks else None}
        if role == "decode":
            queries = total("external_prefix_cache_queries_total")
            hits = total("external_prefix_cache_hits_total")
            out[role].update(loaded_fraction=round(hits / queries, 4) if queries else None,
                             load_failures=int(total("kv_load_failures_total")))
    return out


def run_round(args: argparse.Namespace, setup: str, r: int, workdir: Path) -> dict:
    load = loadavg()
    url, servers, instances = start_setup(args, setup, r, workdir)
    try:
        shorts, longs, seconds = asyncio.run(drive(args, url))
        result = {"setup": setup, "round": r, "loadavg": load, **figures(shorts, longs, seconds)}
        if setup == "disagg":
            result["transfer"] = transfer_figures(args, instances)
        log(json.dumps(result))
        return result
    finally:
        for server in reversed(servers):
            server.stop()


def median_of(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and k != "round"]
    return {k: round(statistics.median(run[k] for run in runs), 2) for k in keys}


def run(args: argparse.Namespace) -> dict:
    workdir = Path(args.workdir)
    runs = {setup: [] for setup in SETUPS}
    for r in range(args.rounds):
        for setup in rotated(SETUPS, r):
            runs[setup].append(run_round(args, setup, r, workdir))
    medians = {setup: median_of(rs) for setup, rs in runs.items()}
    ratios = {k: round(medians["disagg"][k] / medians["single"][k], 3)
              for k in medians["single"] if medians["single"][k] and k != "loadavg"}
    return {"benchmark": "disagg", "model": args.model, "connector": args.connector,
            "rounds": args.rounds, "workload": {
                k: getattr(args, k) for k in ("short_requests", "short_concurrency",
                                              "short_input", "short_output", "long_requests",
                                              "long_input", "long_output", "long_interval")},
            "median": medians, "disagg_over_single": ratios, "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="an HF model directory (--quick: a tiny llama)")
    p.add_argument("--connector", default="SharedStorageConnector",
                   choices=["SharedStorageConnector", "P2pConnector"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--aserve-args", default="", help="more flags for every aserve instance")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--split-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="disagg: the prefill and the decode instance each on half the cores "
                        "(taskset, OMP_NUM_THREADS), as on their own hardware; the single "
                        "instance has them all. --no-split-cores: both on every core, their "
                        "OpenMP threads contending")
    p.add_argument("--short-requests", type=int, default=32)
    p.add_argument("--short-concurrency", type=int, default=8)
    p.add_argument("--short-input", type=int, default=64)
    p.add_argument("--short-output", type=int, default=128)
    p.add_argument("--long-requests", type=int, default=6)
    p.add_argument("--long-input", type=int, default=1536)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-delay", type=float, default=1.0, help="seconds before the first long")
    p.add_argument("--long-interval", type=float, default=2.0)
    p.add_argument("--ready-timeout", type=float, default=180)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quick", action="store_true",
                   help="a few tiny requests, one round (what the test runs)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="aserve-disagg-")
    if args.model is None and not args.quick:
        parser.error("--model is required (or --quick)")
    if args.quick:
        if args.model is None:
            args.model = str(Path(args.workdir) / "tiny-llama")
        args.rounds, args.dtype, args.block_size = 1, "float32", 4
        args.short_requests, args.short_concurrency, args.short_input = 4, 2, 16
        args.short_output, args.long_requests, args.long_input = 8, 2, 96
        args.long_output, args.long_delay, args.long_interval = 2, 0.1, 0.2
        args.aserve_args = (args.aserve_args + " --max-model-len 256").strip()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick and not (Path(args.model) / "config.json").exists():
        from tests.helpers.hf_models import make_hf_model

        make_hf_model(args.model, "llama")
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
