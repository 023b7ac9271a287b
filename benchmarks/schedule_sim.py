"""An offline scheduling simulator: aserve's real `Scheduler` (and KV cache manager, prefix
cache on) driven by a fake runner whose steps advance a virtual clock by a cost model, under a
closed-loop client like `vllm bench serve --max-concurrency C --ignore-eos`. It compares
prefill-cap policies (`Scheduler._max_prefill_tokens`, replaced on the instance by a copy
here; aserve/ is not touched) on the figures vLLM's client reports. Pure Python, no model, no
timing: a run takes a fraction of a second. Prints one JSON line per run.

    python benchmarks/schedule_sim.py --workload chat --policy default
    python benchmarks/schedule_sim.py --workload prefix --policy "streams:k=2,horizon=32"
    python benchmarks/schedule_sim.py --sweep [--policies "default;decodes:n=4"] [--seeds 5]
    python benchmarks/schedule_sim.py --sensitivity      # the shortlist under cost variants
    python benchmarks/schedule_sim.py --fit benchmarks/results/2026-12-01-itl/\
after_chat_r0_timeline.json                              # the cost model against a step log

A step costs, in seconds (then times exp(N(0, noise)), seeded):

    a + (a_pre if it carries prefill) + b_dec · decodes + b_pre · prefill tokens
      + c_attn · Σ over prefill rows of the keys each attends + c_dec_attn · Σ decode contexts

and the clock advances by that plus `overhead` (the engine's time between forwards, which the
runner does not report; 3 ms in the 2026-12-01 step log). Defaults: smol (SmolLM-135M, bf16)
on the 2-core CPU. The scheduler runs as the server does on CPU (512-token budget, block size
16, FCFS) with the knobs this simulator was written for (ratio 4, `prefill_first_streams` 0:
the defaults before 2026-12-05), and with synchronous steps (async scheduling off): a token
reaches the client when the step that sampled it ends, and a request sent after step N ends
is seen by the scheduler at step N + 1 + `delay_steps` (2: the server's async scheduling has
N + 1 scheduled already, and the request's round trip misses N + 2, as its step log shows),
at once when the scheduler is idle. The client sends its first prompt for two tokens (the readiness
check the step log shows) and then keeps C requests in flight, sending the next prompt the
moment a request's last token arrives; the figures are vLLM's client's (output tok/s over
first send to last token; TTFT; TPOT per request; ITL: every gap, pooled).

Policies (`name:knob=value,...`; every cap is at least one block and at most the budget; a
step without decodes has the whole budget, half of it while the fit cannot tell, as in the
scheduler; D: the streams decoding, (a, b): the scheduler's fit seconds ≈ a + b · tokens):
    default   the scheduler's own method: ratio · a / b (ratio 4), and past 8 streams its
              mixed-step cap at `max_mixed_step_ratio` k (2; k=0: off, the method this
              simulator was written to improve on: `copy`)
    decodes   the scheduler's own method with `prefill_cap_decodes` n (k off)
    copy      a copy of `default:k=0` (the copy is faithful: same figures)
    server    the scheduler's own method with the server's PrefillPolicy defaults (ratio 2,
              prefill_first_streams 3, mixed-step ratio 2)
    target    P ≤ (k - 1)(a / b + D): a step ≤ k × the decode-only step of D streams;
              floored at the pending prefill tokens / horizon
    arrival   ratio · a / b · min(1, n / D), floored at safety × the prompt tokens arriving
              per step (exponential average over `window` steps)
    streams   ratio · a / b while D ≤ few; past that min(ratio · a / b, max(target(k),
              pending / min(per · D, horizon)))
    fixed     ratio · a / b while D ≤ few; past that at most c tokens

`streams` (k=2, few=0, per=2, horizon=32) is what the scheduler now does by default (a test
checks that the two give the same run); `streams:few=8,per=0` is the method before it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import percentile  # noqa: E402

from aserve.config import CacheConfig, PrefillPolicy, SchedulerConfig  # noqa: E402
from aserve.core.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from aserve.core.request import Request  # noqa: E402
from aserve.core.scheduler import Scheduler  # noqa: E402
from aserve.core.step_cost import chunk_cost  # noqa: E402
from aserve.sampling_params import SamplingParams  # noqa: E402

VOCAB_SIZE = 49152
WORKLOADS = {
    "chat": {"input_len": 128, "output_len": 128, "concurrency": 32, "num_prompts": 128},
    "prefix": {"input_len": 128, "output_len": 128, "concurrency": 8, "num_prompts": 32,
               "prefix_len": 1024, "num_prefixes": 4},
    "long": {"input_len": 1536, "output_len": 64, "concurrency": 4, "num_prompts": 16},
}


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step, from its rows; see the module docstring."""

    a: float = 0.009
    a_pre: float = 0.0  # more fixed seconds in a step that carries prefill (0: none measured)
    b_dec: float = 0.00045
    b_pre: float = 0.00026
    c_attn: float = 3.8e-7
    c_dec_attn: float = 1e-8
    overhead: float = 0.003
    noise: float = 0.1
    delay_steps: int = 2

    def seconds(self, rows: list[tuple[int, int, bool]]) -> float:
        """Rows: (tokens computed before, tokens scheduled, is a decode)."""
        total = self.a + (self.a_pre if not all(row[2] for row in rows) else 0.0)
        for start, num, is_decode in rows:
            if is_decode:
                total += self.b_dec + self.c_dec_attn * (start + 1)
            else:  # row p attends p + 1 keys: Σ over p in [start, start + num)
                total += self.b_pre * num + self.c_attn * (num * start + num * (num + 1) / 2)
        return total


# ------------------------------------------------------------------ policies

Policy = Callable[[Scheduler], int | None]


def num_decoding(s: Scheduler) -> int:
    return sum(r.num_computed_tokens >= r.num_prompt_tokens for r in s.running)


def num_pending_prefill(s: Scheduler) -> float:
    """Prompt tokens pending, all of them: the scheduler's own count (the whole prompts of
    running prefills and waiting requests, past their cached prefix, each priced by its
    context: `step_cost.chunk_cost`)."""
    return s._pending_within(sys.maxsize)


def decode_cost(s: Scheduler) -> float:
    """The decoding streams' cost in tokens of the fit: their number plus their contexts' keys
    at the fit's key cost, as the scheduler counts it."""
    k = s.step_cost.key_cost_tokens()
    return sum(chunk_cost(1, r.num_computed_tokens, k) for r in s.running
               if r.num_computed_tokens >= r.num_prompt_tokens)


def guarded(rule: Callable[[Scheduler, float, int], float]) -> Policy:
    """A policy from `rule(s, t, num_decoding)`, t = a / b (the fit's fixed cost in tokens,
    the last good one: `StepCostModel.fixed_cost_tokens`), with the scheduler's own edge
    cases: no cap (None: the whole budget) without a ratio, untimed steps or decodes; half
    the budget while the fit cannot tell; never under one block nor over the budget."""
    def policy(s: Scheduler) -> int | None:
        budget = s.config.max_num_batched_tokens
        num_dec = num_decoding(s)
        if s.config.prefill.max_prefill_step_ratio <= 0 or not s.step_cost.is_timed or not num_dec:
            return None
        tokens = s.step_cost.fixed_cost_tokens()
        if tokens is None:
            return budget // 2
        return min(budget, max(int(rule(s, tokens, num_dec)), s.block_size))
    return policy


def copy_policy(ratio: float = 4.0) -> Policy:
    """The default, copied: ratio · a / b."""
    return guarded(lambda s, t, d: ratio * t)


def target_policy(k: float = 2.0, horizon: float = 16) -> Policy:
    """A mixed step ≤ k × the decode-only step of its D streams, a + b(D + P) ≤ k(a + bD),
    so P ≤ (k - 1)(a / b + D); at least the pending prefill over `horizon` steps."""
    return guarded(lambda s, t, d: max((k - 1) * (t + d), num_pending_prefill(s) / horizon))


def arrival_policy(n: float = 4, safety: float = 3.0, window: float = 256,
                   ratio: float = 4.0) -> Policy:
    """ratio · a / b scaled by n / D past n streams (`prefill_cap_decodes`), never under
    `safety` × the prompt tokens arriving per step (an exponential average over `window`
    steps; whole prompts: a prefix hit is not known on arrival)."""
    seen: set[str] = set()
    rate = [0.0]
    inner = guarded(lambda s, t, d: max(ratio * t * min(1.0, n / d), safety * rate[0]))

    def policy(s: Scheduler) -> int:
        arrived = [r for r in s.waiting if r.request_id not in seen]
        seen.update(r.request_id for r in arrived)
        rate[0] += (sum(r.num_prompt_tokens for r in arrived) - rate[0]) / window
        return inner(s)
    return policy


def streams_policy(k: float = 2.0, few: int = 0,
                   horizon: float = PrefillPolicy.PREFILL_DRAIN_STEPS,
                   per: float = PrefillPolicy.DRAIN_STEPS_PER_DECODE,
                   ratio: float = 4.0) -> Policy:
    """While at most `few` streams decode, the default's ratio · a / b; past that, the
    step-time target of `target` (P ≤ (k - 1)(a / b + D), D the decodes' cost in tokens:
    `decode_cost`), floored by the pending prefill over min(per · D, horizon) steps (per=0:
    over `horizon`; horizon=0: no floor), never above the default's cap. The defaults are the
    scheduler's method; few=8,per=0 the one before it (a prompt spread over 32 steps past 8
    streams only)."""
    def rule(s: Scheduler, t: float, d: int) -> float:
        cap = ratio * t
        if d <= few:
            return cap
        steps = min(per * d, horizon) if per else horizon
        floor = num_pending_prefill(s) / steps if steps else 0.0
        return min(cap, max((k - 1) * (t + decode_cost(s)), floor))
    return guarded(rule)


def fixed_policy(c: float = 64, few: int = 8, ratio: float = 4.0) -> Policy:
    """`streams` with a fixed token cap c past `few` streams instead of the fitted target
    (a reference that does not lean on the fit)."""
    return guarded(lambda s, t, d: ratio * t if d <= few else min(ratio * t, c))


POLICIES: dict[str, Callable[..., Policy | None]] = {
    "default": lambda: None, "decodes": lambda n=4: None, "server": lambda: None,
    "copy": copy_policy,
    "target": target_policy, "arrival": arrival_policy, "streams": streams_policy,
    "fixed": fixed_policy,
}


def parse_policy(spec: str) -> tuple[str, dict[str, float]]:
    name, _, rest = spec.partition(":")
    if name not in POLICIES:
        raise SystemExit(f"unknown policy {name!r}; one of {', '.join(POLICIES)}")
    knobs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        knobs[key] = float(value)
    return name, knobs


# ------------------------------------------------------------------ the simulation

def make_prompts(workload: dict, seed: int) -> list[list[int]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    n, length = workload["num_prompts"], workload["input_len"]
    if "prefix_len" not in workload:
        return [tokens(length) for _ in range(n)]
    num_prefixes = workload["num_prefixes"]
    prefixes = [tokens(workload["prefix_len"]) for _ in range(num_prefixes)]
    prompts = [prefixes[i // (n // num_prefixes)] + tokens(length) for i in range(n)]
    rng.shuffle(prompts)  # as vLLM's prefix_repetition dataset does
    return prompts


def make_scheduler(spec: str, num_blocks: int = 8192) -> Scheduler:
    name, knobs = parse_policy(spec)
    prefill = PrefillPolicy() if name == "server" else PrefillPolicy(
        long_prefill_token_threshold=0, max_prefill_step_ratio=4.0, prefill_first_streams=0,
        prefill_cap_decodes=int(knobs.get("n", 4)) if name == "decodes" else 0,
        max_mixed_step_ratio=knobs.get("k", 2.0) if name == "default" else 0.0)
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=2048,
                             prefill=prefill, async_scheduling=False)
    scheduler = Scheduler(config, CacheConfig(block_size=16, num_blocks=num_blocks,
                                              enable_prefix_caching=True))
    policy = POLICIES[name](**knobs) if name not in ("default", "decodes", "server") else None
    if policy is not None:
        scheduler._max_prefill_tokens = lambda: policy(scheduler)  # type: ignore[method-assign]
    return scheduler


@dataclass
class Step:
    end: float
    seconds: float
    num_prefill: int
    num_decode: int


class Simulation:
    """The scheduler, the fake runner and the clock; `send` adds a request now."""

    def __init__(self, scheduler: Scheduler, cost: StepCost, seed: int) -> None:
        self.scheduler, self.cost = scheduler, cost
        self.rng = random.Random(seed + 1)
        self.clock = 0.0
        self.steps: list[Step] = []
        self.sent: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}
        self.num_outputs: dict[str, int] = {}
        self.inbox: list[tuple[int, Request]] = []  # (first step that may see it, request)

    def send(self, req_id: str, prompt: list[int], output_len: int) -> None:
        """A client sends a request now; the scheduler sees it `delay_steps` steps later (the
        server's async scheduling has the next step scheduled already, and the request's
        round trip misses one more), or at once when it has nothing else to do."""
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        request = Request(req_id, prompt, params, arrival_time=self.clock)
        self.inbox.append((len(self.steps) + self.cost.delay_steps, request))
        self.sent[req_id] = self.clock
        self.token_times[req_id] = []
        self.num_outputs[req_id] = output_len

    def has_work(self) -> bool:
        return bool(self.inbox) or self.scheduler.has_unfinished_requests()

    def step(self) -> list[str]:
        """One step: schedule, cost, sample; returns the requests that finished in it."""
        s = self.scheduler
        idle = not s.has_unfinished_requests()
        for entry in [e for e in self.inbox if idle or e[0] <= len(self.steps)]:
            self.inbox.remove(entry)
            s.add_request(entry[1])
        output = s.schedule()
        rows, sampled = self._execute(output)
        seconds = self.cost.seconds(rows) if rows else 0.0
        if self.cost.noise:
            seconds *= math.exp(self.rng.gauss(0.0, self.cost.noise))
        self.clock += seconds + self.cost.overhead
        num_decode = output.num_decode_tokens
        self.steps.append(Step(self.clock, seconds,
                               output.total_num_scheduled_tokens - num_decode, num_decode))
        finished = []
        runner_output = ModelRunnerOutput(list(output.num_scheduled_tokens), sampled,
                                          forward_seconds=seconds)
        for out in s.update_from_output(output, runner_output):
            self.token_times[out.req_id].extend([self.clock] * len(out.new_token_ids))
            if out.finished:
                finished.append(out.req_id)
        return finished

    def _execute(self, output: SchedulerOutput) -> tuple[list, list[int | None]]:
        rows, sampled = [], []
        for req_id, num in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - num  # schedule() has counted them already
            rows.append((start, num, num == 1 and start >= request.num_prompt_tokens))
            done = request.num_computed_tokens == request.num_tokens
            sampled.append(1 + request.num_tokens % 1000 if done else None)
        return rows, sampled


def run_closed_loop(spec: dict, policy: str, cost: StepCost, seed: int = 0,
                    warmup: bool = True) -> tuple[Simulation, int]:
    """The workload `spec` (as in WORKLOADS) to its end; the simulation and the index of the
    run's first step (after the warm-up). `sim.sent` holds the run's requests only."""
    sim = Simulation(make_scheduler(policy), cost, seed)
    prompts, output_len = make_prompts(spec, seed), spec["output_len"]
    if warmup:  # vLLM's client's readiness check: the first prompt, two tokens (the server's
        sim.send("warmup", prompts[0], 2)  # step log shows a prefill and one decode)
        while sim.has_work():
            sim.step()
    first_step = len(sim.steps)
    sim.sent.clear()
    queue = iter(enumerate(prompts))
    for i, prompt in (next(queue) for _ in range(min(spec["concurrency"], len(prompts)))):
        sim.send(f"r{i}", prompt, output_len)
    while sim.has_work():
        for _ in sim.step():
            nxt = next(queue, None)
            if nxt is not None:
                sim.send(f"r{nxt[0]}", nxt[1], output_len)
    return sim, first_step


def simulate(workload: str, policy: str = "default", cost: StepCost | None = None,
             seed: int = 0, warmup: bool = True) -> dict:
    """One closed-loop run of a named workload; its figures as vLLM's client computes them,
    and step stats."""
    sim, first_step = run_closed_loop(WORKLOADS[workload], policy, cost or StepCost(), seed,
                                      warmup)
    start = sim.steps[first_step - 1].end if first_step else 0.0
    return {"workload": workload, "policy": policy, "seed": seed,
            **figures(sim, start), **step_stats(sim.steps[first_step:])}


def figures(sim: Simulation, start: float) -> dict:
    ttfts, tpots, itls, num_tokens, end = [], [], [], 0, start
    for req_id, sent in sim.sent.items():
        times = sim.token_times[req_id]
        assert len(times) == sim.num_outputs[req_id], (req_id, len(times))
        ttfts.append(times[0] - sent)
        if len(times) > 1:
            tpots.append((times[-1] - times[0]) / (len(times) - 1))
        itls.extend(b - a for a, b in zip(times, times[1:]))
        num_tokens, end = num_tokens + len(times), max(end, times[-1])

    def ms(values: list[float], q: float) -> float:
        return round(percentile(sorted(values), q) * 1000, 1)

    return {"output_tokens_per_s": round(num_tokens / (end - start), 1),
            "ttft_p50_ms": ms(ttfts, 50), "ttft_p99_ms": ms(ttfts, 99),
            "tpot_p50_ms": ms(tpots, 50), "itl_p50_ms": ms(itls, 50),
            "itl_p99_ms": ms(itls, 99), "num_requests": len(ttfts), "num_tokens": num_tokens}


def step_stats(steps: list[Step]) -> dict:
    mixed = [s for s in steps if s.num_prefill and s.num_decode]
    decode_only = [s.seconds for s in steps if s.num_decode and not s.num_prefill]
    return {"num_steps": len(steps), "num_mixed_steps": len(mixed),
            "mixed_prefill_p50": statistics.median([s.num_prefill for s in mixed] or [0]),
            "mixed_step_max_ms": round(max([s.seconds for s in mixed] or [0]) * 1000, 1),
            "decode_only_step_p50_ms": round(statistics.median(decode_only or [0]) * 1000, 1),
            "mean_decodes": round(statistics.fmean(s.num_decode for s in steps), 1)}


def simulate_seeds(workload: str, policy: str, cost: StepCost, seeds: int) -> dict:
    """Median over seeds of every figure."""
    runs = [simulate(workload, policy, cost, seed) for seed in range(seeds)]
    out = {"workload": workload, "policy": policy, "seeds": seeds}
    for key, value in runs[0].items():
        if key not in out and key != "seed" and isinstance(value, (int, float)):
            out[key] = round(statistics.median(r[key] for r in runs), 1)
    return out


# ------------------------------------------------------------------ the timeline fit

def least_squares(xs: list[list[float]], ys: list[float],
                  weights: list[float] | None = None) -> list[float]:
    """Coefficients of y ≈ x · c (normal equations, Gauss-Jordan; a handful of columns)."""
    n = len(xs[0])
    w = weights or [1.0] * len(ys)
    m = [[sum(wi * x[i] * x[j] for x, wi in zip(xs, w)) for j in range(n)]
         + [sum(wi * x[i] * y for x, y, wi in zip(xs, ys, w))] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [v - f * p for v, p in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_timeline(path: Path, cost: StepCost, prompt_len: int = 128) -> dict:
    """Fit a + b_dec · D + b_pre · P to a server step log ([end, prefill, decode, seconds];
    the first step, which pays one-time costs, left out), relative (weights 1 / seconds², as
    for multiplicative noise): as is, with an a_pre term (steps that carry prefill), and net
    of the attention terms at `cost`'s c_attn, c_dec_attn for prompts of `prompt_len` (the
    log has no contexts: a chunk's row attends ~prompt_len / 2 keys, a decode ~1.5 ·
    prompt_len). Also: the log-residual spread, and the median of observed / predicted at
    `cost`, by step kind."""
    steps = [(p, d, sec) for _, p, d, sec in json.loads(path.read_text())["steps"][1:]]
    attn = [cost.c_attn * p * (prompt_len + 1) / 2 + cost.c_dec_attn * d * 1.5 * prompt_len
            for p, d, _ in steps]
    ys = [sec for *_, sec in steps]
    weights = [1 / y ** 2 for y in ys]
    names = ("a", "b_dec", "b_pre", "a_pre")
    out: dict = {"num_steps": len(steps)}
    for name, xs, target in (
            ("fit", [[1.0, d, p] for p, d, _ in steps], ys),
            ("fit_with_a_pre", [[1.0, d, p, float(p > 0)] for p, d, _ in steps], ys),
            ("fit_net_of_attention", [[1.0, d, p] for p, d, _ in steps],
             [y - t for y, t in zip(ys, attn)])):
        coefficients = least_squares(xs, target, weights)
        out[name] = {k: float(f"{v:.3g}") for k, v in zip(names, coefficients)}
    a, b_dec, b_pre = out["fit"].values()
    logs = [math.log(y / (a + b_dec * d + b_pre * p)) for p, d, y in steps]
    mad = statistics.median(abs(v - statistics.median(logs)) for v in logs)
    out["noise_sigma_robust"] = round(1.4826 * mad, 3)  # from the median absolute deviation
    out["noise_sigma_std"] = round(statistics.pstdev(logs), 3)
    for kind, keep in (("decode_only", lambda p, d: p == 0), ("mixed", lambda p, d: p and d)):
        ratios = [y / (cost.a + cost.b_dec * d + cost.b_pre * p + t)
                  for (p, d, y), t in zip(steps, attn) if keep(p, d)]
        out[f"observed_over_model_{kind}"] = round(statistics.median(ratios), 3)
    return out


# ------------------------------------------------------------------ the sweep

SWEEP = (["default", "copy", "decodes:n=4", "decodes:n=8"]
         + [f"target:k={k},horizon={h}" for k in (1.5, 2, 3) for h in (16, 32)]
         + [f"arrival:n={n},safety={f}" for n in (4, 8) for f in (2, 3)]
         + [f"streams:k={k},horizon={h}" for k in (1.5, 1.75, 2, 2.5) for h in (0, 32)]
         + ["streams:k=2,few=8,per=0", "streams:k=2,few=4,per=0", "streams:k=2,per=1"]
         + [f"fixed:c={c}" for c in (64, 96, 128)])
SHORTLIST = ["default", "decodes:n=4", "decodes:n=8", "target:k=2,horizon=32",
             "arrival:n=8,safety=3", "streams:k=1.75", "streams:k=2", "streams:k=2.5",
             "fixed:c=64", "fixed:c=96"]
# Rough fit to the 2026-12-01 runs' step kinds on prefix and long (not only chat): cheaper
# prefill attention, dearer decode attention (a decode row reads 23 KB of K/V per key).
CALIBRATED = {"b_dec": 0.0004, "b_pre": 0.00024, "c_attn": 1.8e-7, "c_dec_attn": 3e-7}
VARIANTS = {"1.5x b_pre": lambda c: replace(c, b_pre=1.5 * c.b_pre),
            "1.5x a": lambda c: replace(c, a=1.5 * c.a),
            "1.5x c_attn": lambda c: replace(c, c_attn=1.5 * c.c_attn),
            "0.5x c_attn": lambda c: replace(c, c_attn=0.5 * c.c_attn),
            "a_pre 5 ms": lambda c: replace(c, a_pre=0.005),
            "noise 0.2": lambda c: replace(c, noise=0.2),
            "calibrated": lambda c: replace(c, **CALIBRATED)}
COLUMNS = (("chat", ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms",
                     "decode_only_step_p50_ms")),
           ("prefix", ("output_tokens_per_s", "ttft_p50_ms", "itl_p99_ms")),
           ("long", ("output_tokens_per_s", "ttft_p50_ms")))


def sweep(policies: list[str], cost: StepCost, seeds: int, label: str = "") -> list[dict]:
    """Every policy on every workload (median of `seeds` runs): JSON lines to stdout, a
    markdown table to stderr (output tok/s also as a ratio to the first policy's)."""
    rows = []
    for policy in policies:
        row = {"policy": policy}
        for workload, keys in COLUMNS:
            result = simulate_seeds(workload, policy, cost, seeds)
            print(json.dumps({**result, "costs": label or "default"}), flush=True)
            row.update({f"{workload}_{k}": result[k] for k in keys})
        rows.append(row)
    header = [k for k in rows[0] if k != "policy"]
    lines = [f"| policy ({label or 'default costs'}) | " + " | ".join(header) + " |",
             "|" + " --- |" * (len(header) + 1)]
    for row in rows:
        cells = [f"{row[k]:g}" + (f" ({row[k] / rows[0][k]:.3f})" if k.endswith("_per_s")
                                  else "") for k in header]
        lines.append(f"| {row['policy']} | " + " | ".join(cells) + " |")
    print("\n".join(lines) + "\n", file=sys.stderr, flush=True)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    parser.add_argument("--policy", default="default", help="name[:knob=value,...]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="every policy, every workload")
    parser.add_argument("--policies", help="policy specs for --sweep, separated by ';'")
    parser.add_argument("--seeds", type=int, default=9, help="runs per --sweep entry (median)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="the shortlist (or --policies) under each cost variant")
    parser.add_argument("--calibrated", action="store_true", help=f"costs {CALIBRATED}")
    parser.add_argument("--fit", type=Path, help="fit the cost model to a step timeline")
    parser.add_argument("--no-warmup", action="store_true")
    for name, value in asdict(StepCost()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cost = StepCost(**{k: getattr(args, k) for k in asdict(StepCost())})
    if args.calibrated:
        cost = replace(cost, **CALIBRATED)
    if args.fit is not None:
        print(json.dumps({"timeline": str(args.fit), **fit_timeline(args.fit, cost)}))
    elif args.sensitivity:
        policies = args.policies.split(";") if args.policies else SHORTLIST
        for label, variant in VARIANTS.items():
            sweep(policies, variant(cost), args.seeds, label)
    elif args.sweep:
        sweep(args.policies.split(";") if args.policies else SWEEP, cost, args.seeds)
    else:
        result = simulate(args.workload, args.policy, cost, args.seed, not args.no_warmup)
        print(json.dumps({**result, "costs": asdict(cost)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
