"""An `LLM` cleans up after itself: `del llm` + `gc.collect()`, a `with` block, `shutdown()` and
interpreter exit each stop the worker thread and every rank and destroy the process groups,
once. Each case runs in a fresh interpreter, as a notebook or script would, and must exit 0 with
nothing on stderr about an abort or a traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import gc, json, sys, threading
import torch.distributed as dist
from aserve import LLM, SamplingParams

MODEL = sys.argv[1]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{{"prompt_token_ids": [5, 6, 7, 8]}}, {{"prompt_token_ids": list(range(20, 45))}}]


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def make(**kwargs):
    return LLM(MODEL, dtype="float32", max_num_batched_tokens=16, block_size=4, **kwargs)


def leftovers():
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("aserve"))
    import multiprocessing
    return {{"threads": threads, "children": len(multiprocessing.active_children()),
            "group": dist.is_initialized()}}


def main():
    results = []
{body}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
"""


def run_script(body: str, model_dir) -> tuple[list, str]:
    code = SCRIPT.format(body=textwrap.indent(textwrap.dedent(body), "    "))
    proc = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for bad in ("terminate called", "Traceback", "Aborted", "Exception ignored"):
        assert bad not in proc.stderr, proc.stderr[-3000:]
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow
def test_tp2_llm_built_used_and_deleted_three_times_in_one_process(llama_dir):
    results, _ = run_script("""
        for _ in range(3):
            llm = make(tensor_parallel_size=2)
            results.append({"tokens": tokens(llm)})
            del llm
            gc.collect()
            results[-1].update(leftovers())
    """, llama_dir)
    assert len(results) == 3
    assert results[0]["tokens"] == results[1]["tokens"] == results[2]["tokens"]
    assert all(len(t) == 6 for t in results[0]["tokens"])
    for r in results:  # nothing of the deleted engine is left running
        assert r["threads"] == [] and r["children"] == 0 and not r["group"]


@pytest.mark.slow
def test_with_block_shutdown_twice_and_exit_with_a_live_llm(llama_dir):
    """Leaving a `with` block, `shutdown()` (twice: the second call does nothing), and a
    pipeline-parallel LLM still alive at interpreter exit."""
    results, _ = run_script("""
        with make(tensor_parallel_size=2) as llm:
            results.append({"tokens": tokens(llm)})
        results[-1].update(leftovers())
        llm = make(tensor_parallel_size=2)
        results.append({"tokens": tokens(llm)})
        llm.shutdown()
        llm.shutdown()
        results[-1].update(leftovers())
        alive = make(pipeline_parallel_size=2)
        results.append({"tokens": tokens(alive)})
        globals()["KEEP"] = alive  # still running when the interpreter exits
    """, llama_dir)
    assert results[0]["tokens"] == results[1]["tokens"] == results[2]["tokens"]
    for r in results[:2]:
        assert r["threads"] == [] and r["children"] == 0 and not r["group"]


@pytest.mark.slow
def test_an_engine_that_fails_to_start_leaves_no_rank_or_group_behind(llama_dir):
    """A KV cache too small for one request fails EngineCore after its ranks started: they are
    stopped and the groups destroyed, so the next LLM in the process starts."""
    results, stderr = run_script("""
        try:
            make(tensor_parallel_size=2, num_kv_blocks=2, max_model_len=64)
        except ValueError as e:
            results.append({"error": str(e)})
        results[-1].update(leftovers())
        llm = make(tensor_parallel_size=2)
        results.append({"tokens": tokens(llm)})
        llm.shutdown()
    """, llama_dir)
    assert "KV cache holds 2 blocks" in results[0]["error"]
    assert results[0]["threads"] == [] and results[0]["children"] == 0
    assert not results[0]["group"]
    assert all(len(t) == 6 for t in results[1]["tokens"])
