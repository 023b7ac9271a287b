#!/usr/bin/env python3
"""llama.cpp's speculative decoding on benchmarks/speculative.py's prompts: `llama-server` on the
same GGUF file, one slot, every core, the prompts (token ids, from --prompts, a JSON list) one
at a time, greedy, --output-len tokens at most: without drafts; with its n-gram lookup
(`--spec-type ngram-simple`, --ngram-n tokens looked up, k drafts); and, with --draft, with
that GGUF as its draft model (`--spec-type draft-simple`, k drafts). After a short warm-up, the
best of --repeats runs each. Prints one JSON line: per configuration output tok/s (tokens over
the wall time of the requests, prefill included, as aserve's figure), the replies' token ids,
and llama.cpp's own draft counts.

    python benchmarks/peers/speculative_llamacpp.py \\
        --server ~/.cache/aserve-peers/llamacpp-venv/bin/llama-server \\
        --model MODEL.gguf --prompts prompts.json [--draft DRAFT.gguf] [-k 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(args: argparse.Namespace, prompts: list[list[int]], flags: list[str]) -> dict:
    port = free_port()
    command = [str(args.server), "-m", str(args.model), "-c", "2048", "--parallel", "1",
               "-t", str(os.cpu_count()), "--host", "127.0.0.1", "--port", str(port),
               "--no-webui", *flags]
    log = open(Path(args.workdir) / f"llamacpp_{port}.log", "w")  # noqa: SIM115
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited ({server.returncode}): see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server not ready in 300 s")
            time.sleep(0.5)

        def complete(ids: list[int], n: int) -> dict:
            body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                    "cache_prompt": False, "return_tokens": True, "stream": False}
            reply = httpx.post(url + "/completion", json=body, timeout=600)
            reply.raise_for_status()
            return reply.json()

        complete(prompts[0], 8)  # warm-up
        best = None
        for _ in range(args.repeats):
            tokens, replies, drafted, accepted = 0, [], 0, 0
            start = time.perf_counter()
            for ids in prompts:
                out = complete(ids, args.output_len)
                replies.append(out.get("tokens", []))
                tokens += len(out.get("tokens", [])) or out.get("tokens_predicted", 0)
                timings = out.get("timings", {})
                drafted += timings.get("draft_n", 0)
                accepted += timings.get("draft_n_accepted", 0)
            run = {"tok_s": tokens / (time.perf_counter() - start), "tokens": tokens,
                   "draft_tokens": drafted, "accepted": accepted, "replies": replies}
            if best is None or run["tok_s"] > best["tok_s"]:
                best = run
        return best
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", type=Path, required=True, help="the llama-server binary")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("-k", type=int, default=3, help="drafts a step")
    ap.add_argument("--ngram-n", type=int, default=3,
                    help="the n-gram lookup's length (llama.cpp's default 12; aserve's "
                         "benchmark looks up 5 down to 2)")
    ap.add_argument("-o", "--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp")
    args = ap.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    k = ["--spec-draft-n-max", str(args.k)]
    configs = {"none": [], "ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n",
                                     str(args.ngram_n), "--spec-ngram-simple-size-m",
                                     str(args.k), *k]}
    if args.draft is not None:
        configs["draft_model"] = ["--spec-type", "draft-simple", "-md", str(args.draft), *k]
    result = {}
    for name, flags in configs.items():
        try:
            result[name] = run_config(args, prompts, flags)
        except (RuntimeError, httpx.HTTPError) as e:
            result[name] = {"error": str(e)}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
