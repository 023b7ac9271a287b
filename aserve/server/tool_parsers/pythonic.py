"""`pythonic`: Llama 3.2 / Llama 4's Python-list calls (the templates ask for
`[func_name1(params_name1=params_value1, ...), func_name2(params)]`):

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

The calls are the whole reply (Llama 4 may wrap them in `<|python_start|>` ... `<|python_end|>`).
They are read with `ast.parse` and nothing is evaluated: each item must be a call by name with
keyword arguments only, each value a literal (strings, numbers, True / False / None, and JSON's
true / false / null, lists, tuples and dicts of them). A reply that opens like such a list
(`[name(`) is held back until it ends; any other streams as content. No `call_patterns`: the
calls are Python, not JSON.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from aserve.server.tool_parsers.base import Call, ParsedTools, ToolParser, free_text

START_TAG, END_TAG = "<|python_start|>", "<|python_end|>"
_MAY_BE_CALLS = re.compile(r"\s*(<\|python_start\|>\s*)?(\[\s*([A-Za-z_][\w.]*\s*(\(|$)|$)|$)")
_NAMED = {"true": True, "false": False, "null": None}


class PythonicToolParser(ToolParser):
    name = "pythonic"
    skip_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedTools:
        if not _MAY_BE_CALLS.match(text) and not START_TAG.startswith(text.lstrip()):
            return ParsedTools(free_text(text, final, ()), [])
        if not final:
            return ParsedTools("", [])
        calls = python_calls(text.strip().removeprefix(START_TAG).removesuffix(END_TAG))
        return ParsedTools("", calls) if calls else ParsedTools(text, [])


def python_calls(source: str) -> list[Call] | None:
    try:
        tree = ast.parse(source.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        return [_call(node) for node in tree.body.elts]
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


def _call(node: ast.expr) -> Call:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs")
        arguments[keyword.arg] = _literal(keyword.value)
    return _dotted_name(node.func), json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def _literal(node: ast.expr) -> Any:
    """A literal's value, as JSON takes it; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(
            node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a finite number")
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED:
        return _NAMED[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("a dict key that is not a string")
        return {key: _literal(value) for key, value in zip(keys, node.values)}
    raise ValueError("not a literal")
