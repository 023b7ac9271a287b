"""Command line: `python -m aserve --model DIR --prompt "..."` generates offline.

(The OpenAI-compatible HTTP server arrives in a later change; until then the CLI runs the
offline engine.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from aserve.engine.arg_utils import EngineArgs
from aserve.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineArgs(model="")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name == "model":
            parser.add_argument(flag, required=True, help="HF model directory")
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = type(default) if default is not None else (str if "str" in str(f.type) else int)
            parser.add_argument(flag, type=kind, default=default)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt to complete (repeat for several)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    ns = parser.parse_args(argv)

    from aserve.engine.llm import LLM  # imports torch: only once arguments are valid

    try:
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                                top_p=ns.top_p, top_k=ns.top_k)
        llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
        outputs = llm.generate(ns.prompt, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        completion = out.outputs[0]
        if ns.json:
            print(json.dumps({"prompt": out.prompt, "text": completion.text,
                              "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{out.prompt}{completion.text}")
    return 0
