"""aserve.structured_output: constrained decoding through llguidance.

    frontend (processor)            compile the request's constraint once, for this tokenizer
                                    (cached by constraint; bad ones are a ValueError -> 400)
    runner (rank 0, worker thread)  a matcher per request: fill its row of the token bitmask
                                    beside the forward (or, for a greedy row on the CPU, check
                                    the unmasked token after), advance by the sampled token

The runner owns the matcher because it samples: under async scheduling its copy of a request's
tokens is the first to know each new token. A preempted request's matcher is rebuilt from its
tokens when it resumes (recompute). Rows without a constraint pay nothing.
"""

from __future__ import annotations

from aserve.structured_output.grammar import (
    GrammarCompiler,
    GrammarMatcher,
    allocate_token_bitmask,
    apply_token_bitmask,
    fill_token_bitmask,
    masked_argmax,
)

__all__ = ["GrammarCompiler", "GrammarMatcher", "allocate_token_bitmask", "apply_token_bitmask",
           "fill_token_bitmask", "masked_argmax"]
