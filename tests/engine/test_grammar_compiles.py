"""Grammar compiles that one client cannot use to starve others (issue 39): heavy compiles in
flight leave a cheap constraint and a long plain prompt answered at once; a compile past its
timeout is killed and frees its slot; one that crashes llguidance fails alone; constraints over
the caps are refused before any compile, naming the field; the cache of compiled grammars stays
within its bytes, evicting the least recently used.

The heavy constraint is a 100,000-entry choice (~15 s to compile here) with the caps that would
refuse it raised, so that it reaches a worker.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

import aserve.structured_output.compiler as compiler_module
import aserve.structured_output.constraints as constraints
from aserve import SamplingParams
from aserve.engine import async_engine
from aserve.engine.arg_utils import EngineArgs
from aserve.engine.async_engine import AsyncEngine
from aserve.sampling_params import StructuredOutputsParams
from aserve.structured_output import GrammarCompiler
from aserve.structured_output.compiler import GrammarCache

pytestmark = pytest.mark.spawns  # compile worker processes


def heavy_choice(k: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=[f"option {i} of many, list {k}" for i in range(100_000)])


def wide_schema(num_properties: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer"}
                                             for i in range(num_properties)}}


def deep_lark(depth: int) -> str:
    """Rules nested `depth` deep: llguidance 1.9.1 overflows its stack (SIGSEGV) on 3,000."""
    rules = "\n".join(f'r{i}: "a" r{i + 1}? | "b"' for i in range(depth))
    return f'start: r0\n{rules}\nr{depth}: "z"'


@pytest.fixture
def raised_caps(monkeypatch):
    """Caps out of the way: the heavy choice reaches a worker and takes its ~15 s there."""
    monkeypatch.setattr(constraints, "MAX_CHOICES", 10**6)
    monkeypatch.setattr(constraints, "MAX_CONSTRAINT_CHARS", 10**8)
    monkeypatch.setattr(compiler_module, "MAX_GRAMMAR_SYMBOLS", 10**7)


@pytest.fixture
def compiler(tok):
    compiler = GrammarCompiler(tok.backend, 512, tok.eos_token_ids)
    yield compiler
    compiler.pool.close()


def live_compile_workers() -> list[int]:
    """The pids of this process's compile workers still running (not zombies)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if (int(fields[1]) == os.getpid() and fields[0] != "Z"
                and b"compile_worker" in cmdline):
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow  # an engine, and heavy compiles until their 4 s timeout
def test_a_cheap_constraint_and_a_long_prompt_are_answered_while_heavy_compiles_run(
        model_dir_factory, raised_caps, monkeypatch):
    """Row 3 at small scale: 8 heavy compiles in flight (more than the loop's default thread
    pool has threads); a ["yes", "no"] choice and a long plain prompt are answered meanwhile,
    and each heavy request is refused at its timeout."""
    monkeypatch.setattr(async_engine, "GRAMMAR_COMPILE_TIMEOUT_S", 4.0)

    async def first_text(engine, request_id, prompt, params) -> str:
        return "".join([o.outputs[0].text async for o in engine.generate(request_id, prompt,
                                                                          params)])

    async def main():
        model_dir = model_dir_factory("llama", max_position_embeddings=1024)
        engine = AsyncEngine(EngineArgs(model=str(model_dir), dtype="float32"))
        await engine.start()
        try:
            heavy = [asyncio.create_task(first_text(engine, f"heavy{k}", "Pick:", SamplingParams(
                max_tokens=4, structured_outputs=heavy_choice(k)))) for k in range(8)]
            await asyncio.sleep(0.5)
            choice = await first_text(engine, "victim", "Pick:", SamplingParams(
                temperature=1.0, seed=1, max_tokens=8,
                structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
            long_prompt = await first_text(engine, "long", "hello there " * 200,  # 2,400 chars
                                           SamplingParams(max_tokens=2, ignore_eos=True))
            num_pending = sum(not task.done() for task in heavy)
            results = await asyncio.gather(*heavy, return_exceptions=True)
            return choice, long_prompt, num_pending, results, engine.processor.grammar_compiler()
        finally:
            await engine.shutdown()

    choice, long_prompt, num_pending, results, compiler = asyncio.run(main())
    assert choice in ("yes", "no")
    assert long_prompt
    assert num_pending == 8  # the victims were answered while every heavy compile was in flight
    for result in results:
        assert isinstance(result, ValueError), result
        assert "structured_outputs.choice took longer than 4 s" in str(result)
    compiler.pool.check_invariants()
    assert compiler.pool.num_large_running == 0
    compiler.pool.close()


def test_a_timed_out_compile_is_killed_and_frees_its_slot(raised_caps, compiler):
    """The heavy choice holds the one slot of large constraints until its timeout kills it:
    a large constraint after it compiles within its own timeout (the heavy one would take
    ~15 s more), and no worker is left running the abandoned compile."""
    compiler.compile(StructuredOutputsParams(regex="[a-z]+"))  # the workers are up
    workers = live_compile_workers()
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"structured_outputs\.choice took longer than 1 s"):
        compiler.compile(heavy_choice(0), timeout=1.0)
    assert time.monotonic() - started < 3
    schema = wide_schema(800)  # 28 kB: a large job, so it needs the slot the heavy one had
    compiled = compiler.compile(StructuredOutputsParams(json=schema), timeout=8.0)
    assert '"field_799"' in compiled.grammar
    assert compiler.pool.num_large_running == 0
    compiler.pool.check_invariants()
    now = live_compile_workers()
    assert len(set(workers) - set(now)) == 1  # the heavy compile's worker is gone
    assert len(now) == len(workers)  # and its slot has a new one


def test_a_constraint_that_crashes_llguidance_fails_alone(compiler):
    """A deep grammar overflows llguidance's stack: in-process that is a SIGSEGV of the server;
    here its worker dies, the request gets a 400 and the next constraint compiles."""
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar could not be compiled: "
                                         r"the compiler crashed"):
        compiler.compile(StructuredOutputsParams(grammar=deep_lark(5000)), timeout=30)
    compiled = compiler.compile(StructuredOutputsParams(regex="[0-9]{3}"), timeout=30)
    assert "[0-9]{3}" in compiled.grammar
    compiler.pool.check_invariants()


@pytest.mark.parametrize("spec, message", [
    (dict(choice=[str(i) for i in range(10_001)]),
     r"structured_outputs\.choice has 10001 entries; at most 10000"),
    (dict(json={"enum": ["x" * 1000] * 1100}),
     r"structured_outputs\.json is \d+ characters long as JSON; at most 1048576"),
    (dict(grammar="start: " + "|".join(f'"a{i}"' for i in range(30_000))),
     r"structured_outputs\.grammar could not be compiled: .*grammar size"),
])
def test_a_constraint_over_the_caps_is_refused_naming_its_field(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(StructuredOutputsParams(**spec), timeout=30)


def test_constraints_of_legitimate_size_compile(compiler):
    """Hundreds of choices, a schema of hundreds of properties, the largest choice allowed."""
    for spec in (dict(choice=[f"answer {i}" for i in range(500)]), dict(json=wide_schema(400)),
                 dict(choice=[f"answer {i}" for i in range(10_000)])):
        assert compiler.compile(StructuredOutputsParams(**spec), timeout=30).grammar


def test_the_cache_stays_within_its_bytes_evicting_the_least_recently_used(tok):
    compiler = GrammarCompiler(tok.backend, 512, tok.eos_token_ids, cache_bytes=4000)
    try:
        specs = [StructuredOutputsParams(regex=f"item{i:03d}-[a-z]{{1,{i + 1}}}")
                 for i in range(40)]
        keys = [GrammarCache.key(constraints.constraint_job(spec)) for spec in specs]
        compiler.compile(specs[0])
        for spec in specs[1:]:
            compiler.compile(spec)
            compiler.compile(specs[0])  # used again each time: the most recent
            compiler.cache.check_invariants()
            assert compiler.cache.num_bytes <= 4000
        assert keys[0] in compiler.cache and keys[-1] in compiler.cache
        assert keys[1] not in compiler.cache  # the least recently used went first
        assert 2 < len(compiler.cache) < 40
    finally:
        compiler.pool.close()


def test_grammar_cache_evicts_in_lru_order_and_keeps_nothing_larger_than_itself():
    grammar = "g" * 100
    size = GrammarCache.entry_bytes(GrammarCache.key("a"), grammar)
    cache = GrammarCache(max_bytes=3 * size)
    for name in "abc":
        cache.put(GrammarCache.key(name), grammar)
    assert cache.get(GrammarCache.key("a")) == grammar  # a is now the most recent
    cache.put(GrammarCache.key("d"), grammar)
    assert [GrammarCache.key(n) in cache for n in "abcd"] == [True, False, True, True]
    cache.put(GrammarCache.key("huge"), "h" * (3 * size))
    assert GrammarCache.key("huge") not in cache and len(cache) == 3
    cache.check_invariants()
    assert cache.num_bytes == 3 * size
