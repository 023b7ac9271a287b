"""The schemas of benchmarks/structured_outputs.py, and its in-process half: what compiling a
schema and masking tokens cost, through aserve's own `GrammarCompiler` / `GrammarMatcher` /
`apply_token_bitmask` on a model's tokenizer (`grammar_timings`, one dict).

    SCHEMA          an order: nine required properties (bounded integers and strings, a
                    pattern, enums, a boolean, an array of strings, a nested object)
    large_schema(n) n required properties of six kinds, objects nested three deep, arrays of
                    objects (120: ~25 k characters of schema)

Figures: the tokenizer's set-up (llguidance's view of the vocabulary); the first compile and the
first mask fill of the process; the large schema compiled cold (variants differing only in their
title, so each misses the cache) and cached; a matcher's construction (the runner builds one
per request, in its step); `fill_bitmask` per token along a valid instance of each schema, and
along SCHEMA's instance under SCHEMA without its string bounds (`unbounded_strings`: what the
bounds cost); `apply_token_bitmask` on a batch beside its reference twin.
"""

from __future__ import annotations

import json
import random
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import best_time, summarize_ms, vocab_size_of  # noqa: E402

SCHEMA = {
    "title": "order",
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "customer": {"type": "string", "minLength": 1, "maxLength": 24},
        "email": {"type": "string", "minLength": 3, "maxLength": 32},
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$", "examples": ["KTX-0420"]},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "gift": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 4},
        "shipping": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                           "country": {"enum": ["US", "DE", "FR", "JP", "BR", "IN"]},
                           "express": {"type": "boolean"}},
            "required": ["city", "country", "express"],
            "additionalProperties": False,
        },
    },
    "required": ["order_id", "customer", "email", "sku", "status", "priority", "gift", "tags",
                 "shipping"],
    "additionalProperties": False,
}
WORDS = ("north", "river", "amber", "quiet", "delta", "maple", "orbit", "cedar", "lumen", "atlas")


def large_schema(num_properties: int) -> dict:
    """An object of `num_properties` required properties cycling through six kinds: bounded
    strings and integers, enums, booleans, arrays of objects, and objects nested three deep."""
    item = _object({"key": {"enum": ["a", "b", "c", "d"]},
                    "value": {"type": "integer", "minimum": -100, "maximum": 100}})
    nested = _object({"label": {"type": "string", "maxLength": 16},
                      "count": {"type": "integer", "minimum": 0, "maximum": 10000},
                      "inner": _object({"flag": {"type": "boolean"},
                                        "items": {"type": "array", "items": item,
                                                  "maxItems": 3}})})
    kinds = {"text": {"type": "string", "minLength": 1, "maxLength": 20},
             "number": {"type": "integer", "minimum": 0, "maximum": 1000000},
             "choice": {"enum": ["low", "medium", "high", "critical"]},
             "flag": {"type": "boolean"},
             "list": {"type": "array", "items": item, "minItems": 1, "maxItems": 4},
             "group": nested}
    names = list(kinds)
    return _object({f"field_{i:03d}_{names[i % 6]}": kinds[names[i % 6]]
                    for i in range(num_properties)})


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def without_string_bounds(schema: Any) -> Any:
    """`schema` with every minLength / maxLength removed."""
    if isinstance(schema, dict):
        return {k: without_string_bounds(v) for k, v in schema.items()
                if k not in ("minLength", "maxLength")}
    return schema


def instance_of(schema: dict, rng: random.Random) -> Any:
    """A value that validates against `schema` (of the keywords used here), seeded."""
    if "examples" in schema:
        return schema["examples"][0]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        return {k: instance_of(v, rng) for k, v in schema["properties"].items()}
    if kind == "array":
        size = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [instance_of(schema["items"], rng) for _ in range(size)]
    if kind == "string":
        text = " ".join(rng.choice(WORDS) for _ in range(6))[:rng.randint(
            schema.get("minLength", 0), schema.get("maxLength", 24))]
        return text.strip() or "x"
    if kind == "integer":
        return rng.randint(schema.get("minimum", 0), schema.get("maximum", 100))
    return rng.random() < 0.5  # boolean


# ---------------------------------------------------------------------------------- timings

def fill_walk(compiled, token_ids: list[int], bitmask) -> list[float]:
    """Seconds of each fill_bitmask along `token_ids` (each checked allowed, then accepted),
    and of the one after the last token (the grammar ended: stop tokens only)."""
    from aserve.structured_output import GrammarMatcher

    matcher, seconds = GrammarMatcher(compiled), []
    for token_id in [*token_ids, None]:
        t0 = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        seconds.append(time.perf_counter() - t0)
        if token_id is None:
            break
        if not (int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1:
            raise RuntimeError(f"token {token_id} of a valid instance was masked out")
        matcher.accept_token(token_id)
    if not matcher.is_terminated:
        raise RuntimeError("the grammar did not end with its instance")
    return seconds


def fill_figures(compiled, token_ids: list[int], bitmask) -> dict:
    fills = fill_walk(compiled, token_ids, bitmask)
    return {"fill_bitmask_us": summarize_ms(s * 1e3 for s in fills),  # ms of ms: microseconds
            "fill_bitmask_us_total_per_instance": round(sum(fills) * 1e6, 1)}


def schema_timings(compiler, tokenizer, schema: dict, rng: random.Random, bitmask,
                   instance: Any = None) -> dict:
    """One schema's figures along `instance` (default: a new one of its own)."""
    from aserve.sampling_params import StructuredOutputsParams
    from aserve.structured_output import GrammarMatcher

    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)  # the server's
    compiled = compiler.compile(spec)
    text = json.dumps(instance_of(schema, rng) if instance is None else instance,
                      separators=(",", ":"))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return {"num_properties": len(schema["properties"]), "instance_chars": len(text),
            "instance_tokens": len(token_ids),
            # (built on first use: is_terminated builds it, as the first fill would)
            "matcher_init_ms": round(best_time(
                lambda: GrammarMatcher(compiled).is_terminated) * 1e3, 3),
            "cached_compile_us": round(best_time(lambda: compiler.compile(spec)) * 1e6, 1),
            **fill_figures(compiled, token_ids, bitmask)}


def cold_compiles(compiler, schema: dict, num_variants: int) -> list[float]:
    """Seconds of compiling `num_variants` variants of `schema` (a new title each: a new cache
    key, the same grammar work)."""
    from aserve.sampling_params import StructuredOutputsParams

    seconds = []
    for k in range(num_variants):
        spec = StructuredOutputsParams(json={**schema, "title": f"variant {k}"},
                                       disable_any_whitespace=True)
        t0 = time.perf_counter()
        compiler.compile(spec)
        seconds.append(time.perf_counter() - t0)
    return seconds


def apply_timings(vocab_size: int, batch: int) -> dict:
    """Milliseconds of masking a [batch, vocab] float32 batch as the runner does (every row
    constrained: no index; every other row: an index), beside the reference twin's."""
    import torch

    from aserve.structured_output import allocate_token_bitmask, apply_token_bitmask
    from aserve.structured_output.grammar import apply_token_bitmask_ref

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab_size, generator=gen)  # [batch, vocab]
    bitmask = allocate_token_bitmask(batch, vocab_size)
    bitmask.random_(generator=gen)  # half the tokens allowed
    half = torch.arange(0, batch, 2)
    figures: dict[str, dict[str, float]] = {}
    for name, fn in (("apply_token_bitmask_ms", apply_token_bitmask),
                     ("apply_token_bitmask_ref_ms", apply_token_bitmask_ref)):
        figures[name] = {
            f"{batch}_of_{batch}_rows": round(best_time(partial(fn, logits, bitmask)) * 1e3, 3),
            f"{len(half)}_of_{batch}_rows": round(best_time(
                partial(fn, logits, bitmask[:len(half)], half)) * 1e3, 3)}
    new, ref = figures.values()
    figures["apply_token_bitmask_over_ref"] = {k: round(new[k] / ref[k], 3) for k in new}
    return figures


def grammar_timings(model: str, batch: int, large_properties: int, cold_variants: int,
                    seed: int = 0) -> dict:
    from aserve.engine.tokenizer import Tokenizer
    from aserve.sampling_params import StructuredOutputsParams
    from aserve.structured_output import GrammarCompiler, GrammarMatcher, allocate_token_bitmask

    tokenizer, vocab = Tokenizer.from_dir(model), vocab_size_of(model)
    rng, t0 = random.Random(seed), time.perf_counter()
    compiler = GrammarCompiler(tokenizer.backend, vocab, tokenizer.eos_token_ids)
    t1 = time.perf_counter()
    compiled = compiler.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    t2 = time.perf_counter()
    bitmask = allocate_token_bitmask(1, vocab)
    GrammarMatcher(compiled).fill_bitmask(bitmask, 0)  # the first of this process
    result = {"vocab_size": vocab, "tokenizer_setup_ms": round((t1 - t0) * 1e3, 1),
              "first_compile_ms": round((t2 - t1) * 1e3, 2),
              "first_fill_bitmask_ms": round((time.perf_counter() - t2) * 1e3, 2)}
    instance = instance_of(SCHEMA, rng)
    result["schema"] = schema_timings(compiler, tokenizer, SCHEMA, rng, bitmask, instance)
    result["schema_unbounded_strings"] = schema_timings(
        compiler, tokenizer, without_string_bounds(SCHEMA), rng, bitmask, instance)
    large = large_schema(large_properties)
    result["large_schema"] = {
        "schema_chars": len(json.dumps(large)),
        "cold_compile_ms": summarize_ms(cold_compiles(compiler, large, cold_variants)),
        **schema_timings(compiler, tokenizer, large, rng, bitmask)}
    result.update(apply_timings(vocab, batch))
    return result
