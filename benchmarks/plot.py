"""PNG plots of `compare.py` results for BENCHMARKS.md (matplotlib, Agg backend): serving
throughput vs concurrency, TTFT and TPOT distributions (CDFs) per engine, offline throughput.

    python benchmarks/plot.py RESULT.json --out DIR     # RESULT.json: compare.py's JSON line

The latency CDFs read the per-request records that `serve.py --save-raw` wrote (their paths are
in the result). Needs the `bench` extra (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = {"aserve": "tab:blue", "vllm": "tab:orange", "hf": "tab:green"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_serve_throughput(serve: dict, path: Path) -> None:
    """Output tokens/s (best round) against concurrency, one line per engine."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for engine, by_c in serve["engines"].items():
        cs = sorted(by_c, key=int)
        ax.plot([int(c) for c in cs], [by_c[c]["output_tokens_per_s"] for c in cs], "o-",
                label=engine, color=COLORS.get(engine))
    ax.set_xscale("log", base=2)
    ax.set_xticks(serve["concurrency"], [str(c) for c in serve["concurrency"]])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"serving throughput, {serve['input_len']} in / {serve['output_len']} out")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _raw_values(raw_path: str, key: str) -> list[float]:
    values = []
    for line in Path(raw_path).read_text().splitlines():
        record = json.loads(line)
        if record["ok"] and record.get(key) is not None:
            values.append(record[key] * 1000)
    return sorted(values)


def plot_latency_cdf(serve: dict, key: str, label: str, path: Path) -> None:
    """Empirical CDF of one per-request latency (`ttft_s` or `tpot_s`), per engine (colour)
    and concurrency (line style)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ["-", "--", ":", "-."]
    for engine, by_c in serve["engines"].items():
        for j, c in enumerate(sorted(by_c, key=int)):
            values = _raw_values(by_c[c]["raw"], key)
            if not values:
                continue
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post", color=COLORS.get(engine),
                    linestyle=styles[j % len(styles)], label=f"{engine} c={c}")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{label} distribution")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_offline(offline: dict, path: Path) -> None:
    """Offline output tokens/s per engine (best round), with the matmul-bound limit if known."""
    plt = _pyplot()
    engines = [e for e in ("aserve", "vllm", "hf") if e in offline]
    fig, ax = plt.subplots(figsize=(5, 4))
    values = [offline[e]["output_tokens_per_s"] for e in engines]
    ax.bar(engines, values, color=[COLORS[e] for e in engines])
    limit = offline.get("matmul_limit", {}).get("limit_output_tokens_per_s")
    if limit:
        ax.axhline(limit, color="gray", linestyle="--", label="matmul-bound limit")
        ax.legend()
    ax.set_ylabel("output tokens/s")
    ax.set_title("offline throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_all(result: dict, out_dir: Path) -> list[str]:
    """Every plot the result has data for; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if "serve" in result:
        for name, draw in (
                ("serve_throughput.png", lambda p: plot_serve_throughput(result["serve"], p)),
                ("ttft_cdf.png", lambda p: plot_latency_cdf(result["serve"], "ttft_s", "TTFT", p)),
                ("tpot_cdf.png", lambda p: plot_latency_cdf(result["serve"], "tpot_s", "TPOT", p))):
            draw(out_dir / name)
            written.append(str(out_dir / name))
    if "offline" in result:
        plot_offline(result["offline"], out_dir / "offline_throughput.png")
        written.append(str(out_dir / "offline_throughput.png"))
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a file holding compare.py's JSON line")
    ap.add_argument("--out", required=True, help="directory for the PNGs")
    args = ap.parse_args()
    result = json.loads(Path(args.result).read_text().strip().splitlines()[-1])
    print(json.dumps({"plots": plot_all(result, Path(args.out))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
