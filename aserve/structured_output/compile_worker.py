"""The grammar-compile worker: `python -m aserve.structured_output.compile_worker`, a process of
its own that `CompilePool` starts, feeds and kills. Not torch, not the engine: llguidance, the
tokenizer and one compile at a time.

Its pipes carry JSON lines. stdin: first the setup {"tokenizer": the tokenizer's JSON,
"vocab_size", "eos_token_ids", "stack_bytes", "memory_bytes", "max_grammar_symbols"}, then one
`constraint_job` text a line; stdout: one `compile_job` reply a line, in order. It ends when
stdin closes. Compiles run on a thread of `stack_bytes` (half what the runner's threads get):
llguidance recurses over a grammar's nesting and a deep enough one overflows the stack (a
SIGSEGV), so a grammar that compiles here also builds its matcher in the runner. The address
space is capped at `memory_bytes`: a compile past it fails (the process aborts) instead of
taking the host's memory.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
from typing import IO

from aserve.structured_output.constraints import compile_job


def serve(setup: dict, replies: IO[str]) -> None:
    import llguidance

    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab_size"],
                                       eos_token=setup["eos_token_ids"] or None)
    limits = llguidance.LLParserLimits(max_grammar_size=setup["max_grammar_symbols"])
    for line in sys.stdin:
        replies.write(json.dumps(compile_job(line, tokenizer, limits)) + "\n")
        replies.flush()


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")  # fd 1 becomes stderr: a stray print cannot corrupt
    os.dup2(2, 1)
    setup = json.loads(sys.stdin.readline() or "null")
    if setup is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    memory = setup["memory_bytes"] if hard == resource.RLIM_INFINITY else min(
        setup["memory_bytes"], hard)
    resource.setrlimit(resource.RLIMIT_AS, (memory, hard))
    threading.stack_size(setup["stack_bytes"])
    thread = threading.Thread(target=serve, args=(setup, replies), name="compile")
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
