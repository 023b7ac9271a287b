"""A request's constraint as the text of a compile job, and that job's work: the llguidance
grammar of the constraint, checked against the tokenizer. Torch-free: the compile worker
process (`compile_worker.py`) imports this module and llguidance only.

    constraint_job(spec)               frontend: size caps (ValueError naming the field), the
                                       job's JSON text (also the cache key)
    compile_job(text, tokenizer, ...)  worker: {"grammar": ...} or {"error": "structured_outputs.
                                       <kind> could not be compiled: ..."}

The caps come before any parsing: a choice of at most `MAX_CHOICES` entries, a constraint of at
most `MAX_CONSTRAINT_CHARS` characters as JSON; llguidance itself refuses a grammar of more than
`MAX_GRAMMAR_SYMBOLS` symbols (its limit, ten times below its default).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from aserve.sampling_params import StructuredOutputsParams

MAX_CHOICES = 10_000  # entries of a `choice`
MAX_CONSTRAINT_CHARS = 1 << 20  # a constraint's JSON text (schema, regex, grammar, choices)
MAX_GRAMMAR_SYMBOLS = 20_000  # llguidance's `max_grammar_size` (its default: 500,000)


def constraint_job(spec: StructuredOutputsParams) -> str:
    """The JSON text a worker compiles `spec` from: [kind, value, disable_any_whitespace].
    ValueError naming the field for one over the caps. Key order is kept: a schema's property
    order is its output's."""
    kind = spec.kind
    value = getattr(spec, kind)
    if kind == "choice" and len(value) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice has {len(value)} entries; at most "
                         f"{MAX_CHOICES} are allowed.")
    text = json.dumps([kind, value, spec.disable_any_whitespace], ensure_ascii=False)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"structured_outputs.{kind} is {len(text)} characters long as JSON; "
                         f"at most {MAX_CONSTRAINT_CHARS} are allowed.")
    return text


def compile_job(text: str, tokenizer: Any, limits: Any) -> dict[str, str]:
    """{"grammar": llguidance's grammar} of a `constraint_job` text, checked against
    `tokenizer` (an `llguidance.LLTokenizer`) under `limits` (`LLParserLimits`); or {"error":
    the message of the 400}."""
    import llguidance

    kind, value, disable_any_whitespace = json.loads(text)
    try:
        grammar = grammar_of(kind, value, disable_any_whitespace, tokenizer)
    except ValueError as e:
        return {"error": str(e)}
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
    if error:
        return {"error": f"structured_outputs.{kind} could not be compiled: {first_line(error)}"}
    return {"grammar": grammar}


def grammar_of(kind: str, value: Any, disable_any_whitespace: bool,
               tokenizer: Any = None) -> str:
    """llguidance's grammar of one constraint, unchecked; ValueError naming the field.
    `tokenizer` (an `llguidance.LLTokenizer`) tells a structural tag's triggers that are
    special tokens from text."""
    import llguidance

    options = {"whitespace_flexible": not disable_any_whitespace}
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(_json_schema(value),
                                                                 defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=options)
        if kind == "regex":
            return llguidance.grammar_from("regex", value)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(value))
        if kind == "grammar":  # Lark, or GBNF / EBNF (`root ::= ...`)
            return llguidance.grammar_from("grammar", value)
        return _structural_tag(value, tokenizer)
    except Exception as e:  # llguidance's parse errors (ours name the field already)
        if str(e).startswith("structured_outputs"):
            raise ValueError(str(e)) from None
        raise ValueError(f"structured_outputs.{kind} could not be compiled: "
                         f"{first_line(e)}") from None


def _structural_tag(value: str | dict[str, Any], tokenizer: Any = None) -> str:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}:
    free text in which each trigger starts a begin-schema-end segment, as a Lark grammar:

        start: piece* TEXT                   free text, then ...
        piece: TEXT <[other specials]>       ... a special token that is no trigger, or
             | tag_0 | tag_1 | ...           ... a segment
        tag_i: head_i "begin[len(trigger):]" %json {schema} "end"
               (a structure with a Lark `grammar` instead of a `schema`: @that grammar)
        head_i: TEXT <[trigger id]> | head_i_text
        head_i_text[lazy]: TEXT "trigger"

    A trigger starts its segment whether the model writes it as the special token of that
    name (Qwen's `<tool_call>`, Llama's `<|python_tag|>`) or spells it out in text (the demo
    model writes "<tool_call>" in 4 tokens): a lazy lexeme ends the free text at its first
    occurrence. llguidance reads every added token of a tokenizer as special and never as
    text, so a begin or end that holds one (`</tool_call>`) names it by id, and free text may
    hold any special token but a trigger (`<think>`, an EOS)."""
    tag = json.loads(value) if isinstance(value, str) else value
    if not isinstance(tag, dict) or not tag.get("structures") or not tag.get("triggers"):
        raise ValueError("structured_outputs.structural_tag needs structures and triggers.")
    rules, trigger_ids, side = [], set(), []
    for i, item in enumerate(tag["structures"]):
        trigger = next((t for t in tag["triggers"] if item["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structured_outputs.structural_tag: no trigger starts "
                             f"{item['begin']!r}.")
        if isinstance(item.get("grammar"), str):  # a Lark grammar of its own (qwen3_coder's)
            body = f"@tag_{i}_grammar"
            side.append({"name": f"tag_{i}_grammar", "lark_grammar": item["grammar"]})
        else:
            body = "%json " + json.dumps(item.get("schema") or {}, ensure_ascii=False)
        rules.append(f"tag_{i}: head_{i} {_lark_text(item['begin'][len(trigger):], tokenizer)} "
                     f"{body} {_lark_text(item['end'], tokenizer)}")
        heads = [f"head_{i}_text"]
        rules.append(f"head_{i}_text[lazy]: TEXT {json.dumps(trigger)}")
        if (token := _special_token(trigger, tokenizer)) is not None:
            heads.insert(0, f"TEXT <[{token}]>")
            trigger_ids.add(token)
        rules.append(f"head_{i}: {' | '.join(heads)}")
    pieces = [f"tag_{i}" for i in range(len(tag["structures"]))]
    if other := _id_ranges(_special_ids(tokenizer) - trigger_ids):
        pieces.insert(0, f"TEXT <[{other}]>")
    lark = "\n".join(["%llguidance {}", "start: piece* TEXT", f"piece: {' | '.join(pieces)}",
                      *rules, r"TEXT: /(.|\n)*/", ""])
    if not side:
        return lark
    return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": lark}, *side]})


def _lark_text(text: str, tokenizer: Any) -> str:
    """`text` as a Lark sequence: its special tokens (as `tokenizer` reads it) by id, the
    rest as string literals; `""` when empty."""
    if tokenizer is None or not text:
        return json.dumps(text)
    parts, run = [], []
    for token in tokenizer.tokenize_str(text):
        if tokenizer.is_special_token(token):
            if run:
                parts.append(json.dumps(tokenizer.decode_str(run)))
                run = []
            parts.append(f"<[{token}]>")
        else:
            run.append(token)
    if run:
        parts.append(json.dumps(tokenizer.decode_str(run)))
    return " ".join(parts)


def _special_token(text: str, tokenizer: Any) -> int | None:
    """The id of the one special token `text` is, if it is one."""
    if tokenizer is None:
        return None
    ids = tokenizer.tokenize_str(text)
    return ids[0] if len(ids) == 1 and tokenizer.is_special_token(ids[0]) else None


@functools.lru_cache(maxsize=4)  # (holds the tokenizers it saw: a worker keeps one)
def _special_ids(tokenizer: Any) -> frozenset[int]:
    if tokenizer is None:
        return frozenset()
    return frozenset(i for i in range(tokenizer.vocab_size) if tokenizer.is_special_token(i))


def _id_ranges(ids: set[int] | frozenset[int]) -> str:
    """"1-3,7" for {1, 2, 3, 7}: llguidance's token-id ranges."""
    ranges: list[list[int]] = []
    for i in sorted(ids):
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)


def _json_schema(value: str | dict[str, Any]) -> dict[str, Any] | bool:
    """The schema as an object, checked against its own metaschema (jsonschema)."""
    import jsonschema

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise ValueError("structured_outputs.json must be a JSON schema object.")
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as e:
        raise ValueError(f"structured_outputs.json is not a valid JSON schema: "
                         f"{e.message}") from None
    return value


def first_line(error: Exception | str) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]
