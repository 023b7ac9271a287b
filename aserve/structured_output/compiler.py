"""`GrammarCompiler`: a request's constraint -> a grammar checked against the model's tokenizer,
compiled in worker processes (`CompilePool`) and kept in a `GrammarCache`.

    compile_async(spec, ..., timeout)    the server, on the event loop: no thread of the loop's
    compile(spec, ..., timeout=None)     the offline LLM, blocking
        caps (`constraint_job`) ─► cache hit? ─► pool: smallest job first, one slot kept
        for small ones ─► the worker's grammar, or its 400 ─► cache (LRU, bounded in bytes)

Why processes and not threads (llguidance 1.9.1): a compile cannot be stopped once it starts
(no deadline; its limits bound a grammar's size, not its time: a large `choice` within them
compiles for seconds, and even one past `MAX_GRAMMAR_SYMBOLS` takes a while to be refused), and
a deep enough grammar overflows the stack of the thread compiling it, a SIGSEGV that would take
the server down (a 70 kB Lark chain of optional rules, an 80 kB JSON schema of 1,000 chained
$refs). A worker is killed when its request stops waiting (timeout, disconnect), and a crash
fails one request. The cost: a worker's start (imports, its own tokenizer), once; its memory;
and the pipes and JSON around each compile (docs/benchmarks/structured-outputs.md, "Figures
behind code comments").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from aserve.sampling_params import StructuredOutputsParams
from aserve.structured_output.compile_pool import CompileJob, CompilePool, WorkerDied
from aserve.structured_output.constraints import MAX_GRAMMAR_SYMBOLS, constraint_job

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_BYTES = int(float(os.environ.get("ASERVE_GRAMMAR_CACHE_MB", 64)) * (1 << 20))
GRAMMAR_COMPILE_WORKERS = int(os.environ.get("ASERVE_GRAMMAR_COMPILE_WORKERS", 2))
ENTRY_OVERHEAD_BYTES = 200  # a cache entry's key object and dict slot, beside its text


class CompiledGrammar:
    """A checked grammar and the tokenizer it is for: what a request's matcher starts from;
    `start_after_ids` (possibly empty): the tokens after which the grammar applies."""

    def __init__(self, tokenizer: Any, grammar: str, start_after_ids: list[int]) -> None:
        self.tokenizer, self.grammar = tokenizer, grammar
        self.start_after_ids = list(start_after_ids)


class GrammarCache:
    """Compiled grammars by constraint (the SHA-256 of its job text), least recently used
    evicted first so that `num_bytes` (each entry: its grammar's `sys.getsizeof`, key and
    overhead) stays within `max_bytes`. A grammar larger than that alone is not kept."""

    def __init__(self, max_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()  # the loop and an offline caller's threads

    @staticmethod
    def key(job_text: str) -> bytes:
        return hashlib.sha256(job_text.encode()).digest()

    def get(self, key: bytes) -> str | None:
        with self._lock:
            grammar = self._entries.get(key)
            if grammar is not None:
                self._entries.move_to_end(key)
            return grammar

    def put(self, key: bytes, grammar: str) -> None:
        size = self.entry_bytes(key, grammar)
        with self._lock:
            if key in self._entries or size > self.max_bytes:
                return
            while self.num_bytes + size > self.max_bytes:
                old_key, old = self._entries.popitem(last=False)
                self.num_bytes -= self.entry_bytes(old_key, old)
            self._entries[key] = grammar
            self.num_bytes += size

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def entry_bytes(key: bytes, grammar: str) -> int:
        return sys.getsizeof(grammar) + sys.getsizeof(key) + ENTRY_OVERHEAD_BYTES

    def check_invariants(self) -> None:
        with self._lock:
            total = sum(self.entry_bytes(k, g) for k, g in self._entries.items())
            assert total == self.num_bytes <= self.max_bytes, (total, self.num_bytes)


class GrammarCompiler:
    """Turns constraints into llguidance grammars for one tokenizer (`tokenizers.Tokenizer`)
    and a model vocabulary of `vocab_size` rows; `stop_token_ids` end a completed grammar.
    ValueError naming the field for a bad constraint, one over the caps, one that took longer
    than its timeout or one that crashed the compiler."""

    def __init__(self, backend_tokenizer: Any, vocab_size: int,
                 stop_token_ids: tuple[int, ...] | list[int],
                 cache_bytes: int = GRAMMAR_CACHE_BYTES,
                 num_workers: int = GRAMMAR_COMPILE_WORKERS) -> None:
        import llguidance

        self.vocab_size = vocab_size
        tokenizer_json = backend_tokenizer.to_str()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(stop_token_ids) or None)
        self.cache = GrammarCache(cache_bytes)
        self.pool = CompilePool({"tokenizer": tokenizer_json, "vocab_size": vocab_size,
                                 "eos_token_ids": list(stop_token_ids),
                                 "max_grammar_symbols": MAX_GRAMMAR_SYMBOLS}, num_workers)
        weakref.finalize(self, self.pool.close)

    def compile(self, spec: StructuredOutputsParams, start_after_ids: list[int] | None = None,
                timeout: float | None = None) -> CompiledGrammar:
        """The checked grammar of `spec`, blocking. `start_after_ids`: the tokens after which
        it applies (free generation until then)."""
        text, key, grammar = self._lookup(spec)
        if grammar is None:
            job = self.pool.submit(text)
            with self._waiting(spec, job, timeout):
                grammar = self._store(key, job.future.result(timeout))
        return CompiledGrammar(self.tokenizer, grammar, start_after_ids or [])

    async def compile_async(self, spec: StructuredOutputsParams,
                            start_after_ids: list[int] | None, timeout: float) -> CompiledGrammar:
        """`compile` for the event loop, which it never blocks on a compile; past `timeout`
        (or when the caller is cancelled) the compile is dropped or its worker killed."""
        text, key, grammar = self._lookup(spec)
        if grammar is None:
            job = self.pool.submit(text)
            with self._waiting(spec, job, timeout):
                reply = await asyncio.wait_for(asyncio.wrap_future(job.future), timeout)
                grammar = self._store(key, reply)
        return CompiledGrammar(self.tokenizer, grammar, start_after_ids or [])

    def _lookup(self, spec: StructuredOutputsParams) -> tuple[str, bytes, str | None]:
        text = constraint_job(spec)
        key = GrammarCache.key(text)
        return text, key, self.cache.get(key)

    def _store(self, key: bytes, reply: dict) -> str:
        if "error" in reply:
            raise ValueError(reply["error"])
        self.cache.put(key, reply["grammar"])
        return reply["grammar"]

    @contextlib.contextmanager
    def _waiting(self, spec: StructuredOutputsParams, job: CompileJob,
                 timeout: float | None) -> Iterator[None]:
        """Around the wait for `job`: its failures as the 400s they are; and whatever ends the
        wait, the job is not left running for nobody."""
        try:
            yield
        except TimeoutError:
            raise ValueError(f"structured_outputs.{spec.kind} took longer than {timeout:g} s "
                             "to compile.") from None
        except WorkerDied as e:
            logger.warning("A structured_outputs.%s constraint crashed its compile worker "
                           "(exit status %s).", spec.kind, e.returncode)
            raise ValueError(f"structured_outputs.{spec.kind} could not be compiled: the "
                             f"compiler crashed on it (exit status {e.returncode}; too deeply "
                             "nested?).") from None
        finally:
            self.pool.cancel(job)
