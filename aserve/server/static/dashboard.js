// The engine's dashboard: polls dashboard/stats once a second (only while the tab is shown),
// shows each figure in an element with data-metric="<name>" beside a sparkline of its recent
// values, and draws the recent steps' composition. Rates are the change of the server's
// totals over the last few polls, on the server's own clock.

import { getJSON, setUpKeyForm } from "./api.js";
import { sparkline, stepBars } from "./chart.js";

const POLL_MS = 1000;
const HISTORY = 120;  // polls kept for the sparklines: two minutes
const RATE_WINDOW = 5;  // polls a rate spans
const STEP_BARS = 120;  // the server sends up to this many steps

const count = (v) => (v === null ? "–" : Math.round(v).toLocaleString("en-US"));
const percent = (v) => (v === null ? "–" : `${(v * 100).toFixed(1)} %`);
const perSecond = (v) => (v === null ? "–" : v.toFixed(1));
const ms = (v) => (v === null ? "–" : `${(v * 1000).toFixed(v < 0.01 ? 2 : 0)} ms`);
const quantiles = (p) => `p50 ${ms(p.p50)} · p90 ${ms(p.p90)} · p99 ${ms(p.p99)}`;

const polls = [];  // the last HISTORY stats objects, oldest first

function rate(total) {
  return () => {
    const now = polls.at(-1);
    const then = polls[Math.max(0, polls.length - 1 - RATE_WINDOW)];
    const seconds = now.clock_seconds - then.clock_seconds;
    return seconds > 0 ? (now[total] - then[total]) / seconds : null;
  };
}

// data-metric, label, the value charted (from the latest poll), its text, the chart's maximum
const FIGURES = [
  ["requests_running", "Requests running", (s) => s.requests_running, count],
  ["requests_waiting", "Requests waiting", (s) => s.requests_waiting, count],
  ["kv_cache_usage", "KV cache usage", (s) => s.kv_cache_usage, percent, 1],
  ["prefix_cache_hit_rate", "Prefix-cache hit rate (since start)", (s) => s.prefix_cache_hit_rate, percent, 1],
  ["prompt_tokens_per_second", "Prompt tokens / s", rate("prompt_tokens_total"), perSecond],
  ["generation_tokens_per_second", "Generation tokens / s", rate("generation_tokens_total"),
    perSecond],
  ["generation_tokens_total", "Tokens generated", (s) => s.generation_tokens_total, count],
  ["prompt_tokens_total", "Prompt tokens", (s) => s.prompt_tokens_total, count],
  ["requests_finished_total", "Requests finished", (s) => s.requests_finished_total, count],
  ["preemptions_total", "Preemptions", (s) => s.preemptions_total, count],
  ["spec_acceptance_rate", "Draft tokens accepted (since start)", (s) => s.spec_acceptance_rate,
    percent, 1],
  ["spec_mean_accepted_length", "Tokens per verifying step (since start)",
    (s) => s.spec_mean_accepted_length, perSecond],
  ["ttft_seconds", "Time to first token (recent; p50 charted)", (s) => s.ttft_seconds.p50,
    (_, s) => quantiles(s.ttft_seconds)],
  ["itl_seconds", "Inter-token latency (recent; p50 charted)", (s) => s.itl_seconds.p50,
    (_, s) => quantiles(s.itl_seconds)],
].map(([metric, label, value, text, max]) => ({ metric, label, value, text, max }));

function figureView({ metric, label }) {
  const view = document.createElement("section");
  view.className = "figure";
  view.dataset.metric = metric;
  const title = document.createElement("h2");
  title.textContent = label;
  const value = document.createElement("output");
  value.className = "value";
  const chart = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  chart.setAttribute("class", "spark");
  chart.setAttribute("aria-hidden", "true");
  view.append(title, value, chart);
  return view;
}

const views = FIGURES.map(figureView);
const series = FIGURES.map(() => []);
document.getElementById("figures").replaceChildren(...views);

function showFigures(stats) {
  FIGURES.forEach((figure, k) => {
    const value = figure.value(stats) ?? null;
    series[k].push(value);
    if (series[k].length > HISTORY) series[k].shift();
    views[k].querySelector(".value").textContent = figure.text(value, stats);
    sparkline(views[k].querySelector(".spark"), series[k], HISTORY, figure.max);
  });
}

function showSteps(steps) {
  stepBars(document.getElementById("step-bars"), steps, STEP_BARS);
  const n = steps.seconds.length;
  const sum = (list) => list.reduce((a, b) => a + b, 0);
  document.getElementById("step-summary").textContent = n === 0 ? "No steps yet."
    : `${n} steps: ${(sum(steps.prefill_tokens) / n).toFixed(1)} prefill + `
      + `${(sum(steps.decode_tokens) / n).toFixed(1)} decode tokens and `
      + `${((sum(steps.seconds) / n) * 1000).toFixed(1)} ms of model time per step`;
}

async function refresh() {
  const stats = await getJSON("dashboard/stats");
  polls.push(stats);
  if (polls.length > HISTORY) polls.shift();
  document.getElementById("model").textContent = stats.model;
  showFigures(stats);
  showSteps(stats.steps);
  document.getElementById("status").textContent = stats.engine_running
    ? `Live · ${stats.num_kv_blocks.toLocaleString("en-US")} KV blocks · updated `
      + new Date().toLocaleTimeString()
    : "The engine is not running.";
}

let timer;

async function poll() {
  clearTimeout(timer);
  try {
    if (!document.hidden) await refresh();
  } catch (e) {
    document.getElementById("status").textContent = e.message;
    if (e.status === 401) return;  // polling resumes when a key is saved
  }
  timer = setTimeout(poll, POLL_MS);
}

setUpKeyForm(document.querySelector("form.api-key"), poll);
poll();
