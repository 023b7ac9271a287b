"""Serving benchmark: a load generator for any OpenAI-compatible server (aserve, `vllm serve`).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 -n 64 -i 128 -o 128 \\
        --concurrency 8                       # C workers, each sends its next request at once
    python benchmarks/serve.py ... --request-rate 4 [--max-concurrency 16]   # Poisson arrivals
    python benchmarks/serve.py ... --workload prefix-sharing --num-prefixes 4 --prefix-len 512

Every request streams `POST /v1/completions` (`ignore_eos`, `temperature` 0, `max_tokens` O,
`stream_options.include_usage`) over HTTP/1.1 keep-alive, without retries. Prompts are random
token ids from the seeded workload of `common.make_prompts`, the ids every engine gets
(`--prompt-kind ids`, sent as a list of ints), or those ids decoded to text by the model's
tokenizer (`--prompt-kind text`; the server's re-tokenization may give a slightly different
prompt length).

Per request: TTFT (first token chunk), the gaps between token chunks (ITL), TPOT = (e2e - TTFT) /
(output tokens - 1), output tokens (the final usage chunk, else the chunk count). It prints one
JSON line; `--save-raw FILE` writes the per-request records (timings, text, finish reason) as
JSON lines. The prefix-sharing workload gives K long shared prefixes each followed by a unique
suffix of `--input-len` tokens (request i uses prefix i mod K), and adds the server's
prefix-cache hit rate (from `/metrics`, aserve's or vLLM's counter names) and TTFT of each
prefix's first request vs the later ones.

This is a client: it measures what a user sees, and imports nothing of aserve.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_prompts, parse_prometheus, summarize_ms  # noqa: E402

METRIC_PREFIXES = ("aserve:", "vllm:")  # `<prefix>prefix_cache_{hits,queries}_total`
Decoder = Callable[[list[int]], str]


@dataclass
class RequestSpec:
    prompt: list[int] | str
    num_prompt_ids: int
    prefix_index: int | None = None  # prefix-sharing workload: which shared prefix
    first_of_prefix: bool = False


@dataclass
class RequestRecord:
    index: int
    ok: bool = False
    error: str = ""
    start_s: float = 0.0  # since the benchmark began
    start_clock_s: float = 0.0  # time.perf_counter() when sent: TTFT's origin (a Linux server's
    # time.monotonic() is the same clock)
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    prefix_index: int | None = None
    first_of_prefix: bool = False
    text: str = ""  # the completion, as streamed
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# ---------------------------------------------------------------------------------- workload

def build_requests(args: argparse.Namespace, vocab_size: int,
                   decode: Decoder | None) -> list[RequestSpec]:
    """The seeded prompts: random ids, or K shared prefixes + unique suffixes."""
    suffixes = make_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    if args.workload == "random":
        prefixes, pick = [[]], lambda i: 0
    else:
        prefixes = make_prompts(args.num_prefixes, args.prefix_len, vocab_size, args.seed + 1)
        pick = lambda i: i % args.num_prefixes
    specs = []
    for i, suffix in enumerate(suffixes):
        prefix = prefixes[pick(i)]
        prompt = decode(prefix) + decode(suffix) if decode else prefix + suffix
        shared = args.workload != "random"
        specs.append(RequestSpec(prompt, len(prefix) + len(suffix),
                                 pick(i) if shared else None, shared and i < args.num_prefixes))
    return specs


def load_decoder(tokenizer_dir: Path) -> Decoder:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------- requests

def request_body(model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def send(client: httpx.AsyncClient, endpoint: str, body: dict,
               record: RequestRecord) -> RequestRecord:
    """Stream one completion into `record`; a failure is recorded, never raised."""
    t0 = last = record.start_clock_s = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return record
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    record.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                _add_text(chunk, record)
                if _is_token_chunk(chunk):
                    now = time.perf_counter()
                    if record.ttft_s is None:
                        record.ttft_s = now - t0
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    record.num_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    record.e2e_s = time.perf_counter() - t0
    record.output_tokens = record.output_tokens or record.num_chunks
    record.ok = record.ttft_s is not None
    record.error = "" if record.ok else "the stream carried no tokens"
    return record


def _add_text(chunk: dict, record: RequestRecord) -> None:
    for choice in chunk.get("choices") or []:
        record.text += choice.get("text") or ""
        record.finish_reason = choice.get("finish_reason") or record.finish_reason


def _is_token_chunk(chunk: dict) -> bool:
    """A chunk with a choice, unless it is a finish-only one (empty text and a finish_reason):
    a token whose bytes are held back (incomplete UTF-8) still counts."""
    choices = chunk.get("choices") or []
    return bool(choices) and (bool(choices[0].get("text")) or
                              choices[0].get("finish_reason") is None)


# ---------------------------------------------------------------------------------- arrivals

async def run_all(client: httpx.AsyncClient, args: argparse.Namespace, model: str,
                  specs: list[RequestSpec], body_of: Callable[[int], dict] | None = None
                  ) -> tuple[list[RequestRecord], float]:
    """Send every request (fixed concurrency, or Poisson arrivals under a concurrency cap);
    stop at `--timeout`, counting unfinished requests as failed. Returns records and duration.
    `body_of(i)`: request i's body (default: `request_body` of its prompt and `-o`)."""
    records: dict[int, RequestRecord] = {}
    t_begin = time.perf_counter()

    async def one(i: int) -> None:
        spec = specs[i]
        record = RequestRecord(i, start_s=time.perf_counter() - t_begin,
                               prefix_index=spec.prefix_index,
                               first_of_prefix=spec.first_of_prefix)
        records[i] = record
        body = (body_of(i) if body_of is not None
                else request_body(model, spec.prompt, args.output_len))
        await send(client, args.endpoint, body, record)

    if args.request_rate is None:
        pending = iter(range(len(specs)))

        async def worker() -> None:
            for i in pending:
                await one(i)

        tasks = [asyncio.ensure_future(worker()) for _ in range(args.concurrency)]
    else:
        tasks = [asyncio.ensure_future(_poisson(args, one, len(specs)))]
    done, unfinished = await asyncio.wait(tasks, timeout=args.timeout)
    for task in unfinished:
        task.cancel()
    await asyncio.gather(*unfinished, return_exceptions=True)
    duration = time.perf_counter() - t_begin
    for task in done:
        task.result()  # a bug in the benchmark itself is raised, not hidden
    for i in range(len(specs)):
        record = records.setdefault(i, RequestRecord(i))
        if not record.ok and not record.error:
            record.error = f"not finished within --timeout {args.timeout:g} s"
    return [records[i] for i in range(len(specs))], duration


async def _poisson(args: argparse.Namespace, one, num_requests: int) -> None:
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or num_requests)
    start, offset, tasks = time.perf_counter(), 0.0, []

    async def limited(i: int) -> None:
        async with limit:
            await one(i)

    for i in range(num_requests):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        tasks.append(asyncio.ensure_future(limited(i)))
        offset += rng.expovariate(args.request_rate)
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


# ---------------------------------------------------------------------------------- server

async def served_model_name(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def prefix_cache_counters(client: httpx.AsyncClient) -> tuple[float, float] | None:
    """(hits, queries) in tokens from the server's /metrics, or None if it exports neither
    aserve's nor vLLM's names."""
    try:
        response = await client.get("/metrics")
        samples = parse_prometheus(response.text)
    except httpx.HTTPError:
        return None
    for prefix in METRIC_PREFIXES:
        queries = samples.get(f"{prefix}prefix_cache_queries_total")
        if queries is not None:
            return samples.get(f"{prefix}prefix_cache_hits_total", 0.0), queries
    return None


# ---------------------------------------------------------------------------------- report

def summarize(args: argparse.Namespace, model: str, records: list[RequestRecord],
              duration: float) -> dict:
    ok = [r for r in records if r.ok]
    num_out = sum(r.output_tokens for r in ok)
    num_in = sum(r.prompt_tokens for r in ok)
    errors = sorted({r.error for r in records if not r.ok})
    arrival = ({"concurrency": args.concurrency} if args.request_rate is None else
               {"request_rate": args.request_rate, "max_concurrency": args.max_concurrency})
    return {
        "benchmark": "serve", "base_url": args.base_url, "model": model,
        "workload": args.workload, "prompt_kind": args.prompt_kind,
        "num_prompts": len(records), "input_len": args.input_len, "output_len": args.output_len,
        **arrival,
        "completed": len(ok), "failed": len(records) - len(ok), "errors": errors[:3],
        "duration_s": round(duration, 3),
        "input_tokens": num_in, "output_tokens": num_out,
        "request_throughput": round(len(ok) / duration, 3),
        "output_tokens_per_s": round(num_out / duration, 1),
        "total_tokens_per_s": round((num_in + num_out) / duration, 1),
        "ttft_ms": summarize_ms(r.ttft_s for r in ok),
        "tpot_ms": summarize_ms(r.tpot_s for r in ok if r.tpot_s is not None),
        "itl_ms": summarize_ms(gap for r in ok for gap in r.itl_s),
        "e2e_ms": summarize_ms(r.e2e_s for r in ok),
    }


def prefix_report(args: argparse.Namespace, records: list[RequestRecord],
                  before: tuple[float, float] | None,
                  after: tuple[float, float] | None) -> dict:
    ok = [r for r in records if r.ok]
    hits = queries = None
    if before is not None and after is not None:
        hits, queries = after[0] - before[0], after[1] - before[1]
    n, k = len(records), min(args.num_prefixes, len(records))
    return {
        "num_prefixes": args.num_prefixes, "prefix_len": args.prefix_len,
        "prefix_cache_hits": hits, "prefix_cache_queries": queries,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        # tokens of a prefix already sent once, over all prompt tokens: the rate to expect
        # from a cache with no block granularity and no evictions
        "prefix_share_of_prompt_tokens": round(
            (n - k) * args.prefix_len / (n * (args.prefix_len + args.input_len)), 4),
        "ttft_ms_first_of_prefix": summarize_ms(r.ttft_s for r in ok if r.first_of_prefix),
        "ttft_ms_later": summarize_ms(r.ttft_s for r in ok if not r.first_of_prefix),
    }


def save_raw(path: Path, records: list[RequestRecord]) -> None:
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps({**dataclasses.asdict(r), "tpot_s": r.tpot_s}) + "\n")


# ---------------------------------------------------------------------------------- main

async def benchmark(args: argparse.Namespace) -> tuple[dict, list[RequestRecord]]:
    """The run's JSON figures and its per-request records."""
    cap = args.concurrency if args.request_rate is None else (args.max_concurrency or 1000)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
            base_url=args.base_url, headers=headers, timeout=httpx.Timeout(args.timeout),
            limits=httpx.Limits(max_connections=cap, max_keepalive_connections=cap)) as client:
        model = args.model or await served_model_name(client)
        model_dir = Path(args.tokenizer or model)
        if not (model_dir / "config.json").exists() and (
                not args.vocab_size or args.prompt_kind == "text"):
            raise SystemExit(f"{model_dir} is not a model directory: pass --tokenizer DIR"
                             + (" (or --vocab-size N)" if args.prompt_kind == "ids" else ""))
        vocab_size = args.vocab_size or json.loads(
            (model_dir / "config.json").read_text())["vocab_size"]
        decode = load_decoder(model_dir) if args.prompt_kind == "text" else None
        specs = build_requests(args, vocab_size, decode)
        for w in range(args.num_warmups):  # a prompt unrelated to the workload's prefixes
            warm = make_prompts(1, args.input_len, vocab_size, seed=10_000 + w)[0]
            body = request_body(model, decode(warm) if decode else warm, 4)
            record = await send(client, args.endpoint, body, RequestRecord(-1))
            if not record.ok:
                raise RuntimeError(f"warm-up request failed: {record.error}")
        before = await prefix_cache_counters(client)
        records, duration = await run_all(client, args, model, specs)
        after = await prefix_cache_counters(client)
    result = summarize(args, model, records, duration)
    if args.workload == "prefix-sharing":
        result.update(prefix_report(args, records, before, after))
    if args.save_raw:
        save_raw(Path(args.save_raw), records)
    return result, records


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", help="the request's `model` (default: the first of /v1/models)")
    ap.add_argument("--tokenizer", help="model directory with config.json / tokenizer.json "
                                        "(default: the model name, if it is a directory)")
    ap.add_argument("--vocab-size", type=int, help="(default: the tokenizer dir's config.json)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--prompt-kind", choices=["ids", "text"], default="ids")
    ap.add_argument("--workload", choices=["random", "prefix-sharing"], default="random")
    ap.add_argument("-n", "--num-prompts", type=int, default=64)
    ap.add_argument("-i", "--input-len", type=int, default=128,
                    help="prompt tokens (prefix-sharing: the unique suffix's)")
    ap.add_argument("-o", "--output-len", type=int, default=128)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    arrival = ap.add_mutually_exclusive_group()
    arrival.add_argument("--concurrency", type=int, default=8,
                         help="requests in flight (default: 8)")
    arrival.add_argument("--request-rate", type=float, default=None,
                         help="Poisson arrivals, requests/s (instead of --concurrency)")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="cap on requests in flight with --request-rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-warmups", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds for the whole run; unfinished requests count as failed")
    ap.add_argument("--save-raw", metavar="FILE", help="per-request records, JSON lines")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result, _ = asyncio.run(benchmark(args))
    print(json.dumps(result), flush=True)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
