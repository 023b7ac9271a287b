"""aserve.structured_output: constrained decoding through llguidance.

    frontend (processor)            compile the request's constraint once, for this tokenizer,
                                    in worker processes of its own (compiler.py, compile_pool.py,
                                    compile_worker.py; cheap constraints first, a compile past
                                    its timeout killed; bad ones are a ValueError -> 400), kept
                                    in an LRU cache bounded in bytes
    runner (rank 0, worker thread)  a matcher per request: fill its row of the token bitmask
                                    beside the forward (or, for a greedy row on the CPU, check
                                    the unmasked token after), advance by the sampled token

The runner owns the matcher because it samples: under async scheduling its copy of a request's
tokens is the first to know each new token. A preempted request's matcher is rebuilt from its
tokens when it resumes (recompute). Rows without a constraint pay nothing.

The compiler's modules import no torch (a compile worker starts with llguidance alone); the
runner's (`grammar.py`) are imported on first use of one of their names.
"""

from __future__ import annotations

from typing import Any

from aserve.structured_output.compiler import CompiledGrammar, GrammarCompiler

_RUNNER_NAMES = ("GrammarMatcher", "allocate_token_bitmask", "apply_token_bitmask",
                 "fill_token_bitmask", "masked_argmax")

__all__ = ["CompiledGrammar", "GrammarCompiler", *_RUNNER_NAMES]


def __getattr__(name: str) -> Any:
    if name in _RUNNER_NAMES:
        from aserve.structured_output import grammar

        return getattr(grammar, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
