"""`qwen3_coder`: Qwen3-Coder's XML calls, values as raw text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags less one newline at each end; it becomes JSON by the
tool's schema (`ToolParser.tools`): `null` / `None` is null where the schema allows null, else a
string parameter keeps the text; numbers, booleans, objects and arrays are parsed (JSON, or a
Python literal for objects and arrays), else kept as text. Without a schema a value is JSON
where it parses. Also read: a `<function=...>` with no `<tool_call>` around it, a
`</parameter>` left out (the value then ends at the next parameter or `</function>`), a last
`</tool_call>` left out (the reply ended at EOS after `</function>`), and Qwen's JSON call
(`hermes`) inside `<tool_call>`. A call is sent once its `</tool_call>` (bare: `</function>`)
is written.

`call_patterns`: trigger `<tool_call>`, each call `<tool_call>\n<function=NAME>\n` + its
parameters + `</function>\n</tool_call>`, held by a Lark grammar (the values are not JSON):
the tool's parameters in the order its schema lists them, the required ones always, the
others at most once, each `<parameter=KEY>\n` + value + `\n</parameter>\n`; a value the
parser keeps as text (a string, or a type that allows one) is any text up to the first
`</parameter>` (a string enum: one of its values; other string keywords, such as maxLength,
are not held), any other is JSON of the parameter's schema. A tool without `properties` takes
any parameter names, values as text.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from aserve.server.tool_parsers.base import (
    Call,
    CallPattern,
    ParsedTools,
    ToolParser,
    scan,
    tool_name,
    tool_parameters,
)
from aserve.server.tool_parsers.hermes import hermes_calls

CALL, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"[^\s<>=]+")
_CALL_CLOSE = re.compile(r"</function>\s*</tool_call>")


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    skip_special_tokens = False

    def call_patterns(self, tools):
        return [CallPattern(CALL, f"{CALL}\n{FUNCTION}{tool_name(t)}>\n", None,
                            f"{FUNCTION_END}\n{CALL_END}", grammar=parameters_grammar(
                                tool_parameters(t))) for t in tools]

    def parse(self, text: str, final: bool) -> ParsedTools:
        return scan(text, final, (CALL, FUNCTION), self._read)

    def _read(self, text: str, start: int, marker: str, final: bool):
        end_marker = CALL_END if marker == CALL else FUNCTION_END
        close = text.find(end_marker, start + len(marker))
        if marker == CALL:
            rest = text[start + len(CALL):start + len(CALL) + 64].lstrip()
            if not final and FUNCTION.startswith(rest):
                return None  # (not yet known: XML or JSON)
            if rest.startswith(FUNCTION):  # its end: `</function>` then `</tool_call>` (a
                found = _CALL_CLOSE.search(text, start)  # value may hold either tag alone)
                close = found.end() - len(CALL_END) if found else -1 if not final else close
        if close < 0 and not final:
            return None
        end = len(text) if close < 0 else close + len(end_marker)
        body = text[start:end]
        if marker == CALL:
            body = body[len(CALL):].removesuffix(CALL_END).strip()
            if body.startswith(("{", "[")):  # the model fell back on Qwen's JSON calls
                return hermes_calls(body, closed=close >= 0), end
        call = self._function(body)
        return ([call] if call else None), end

    def _function(self, body: str) -> Call | None:
        """`<function=NAME>` + parameters + `</function>` as a call (the last `</function>`
        ends it: a value may hold the tag)."""
        if not body.startswith(FUNCTION):
            return None
        head_end = body.find(">")
        name = body[len(FUNCTION):head_end].strip() if head_end > 0 else ""
        if not _NAME.fullmatch(name):
            return None
        inner = body[head_end + 1:]
        close = inner.rfind(FUNCTION_END)
        if close < 0 or inner[close + len(FUNCTION_END):].strip():
            return None  # cut off, or text after the function inside the call
        parameters = self._parameters(inner[:close])
        if parameters is None:
            return None
        schema = self._properties(name)
        arguments = {key: typed_value(raw, schema.get(key)) for key, raw in parameters.items()}
        return name, json.dumps(arguments, ensure_ascii=False)

    @staticmethod
    def _parameters(inner: str) -> dict[str, str] | None:
        """{key: raw value} of `<parameter=KEY>VALUE</parameter>...`; None if it is not that."""
        out: dict[str, str] = {}
        pos = 0
        while True:
            start = inner.find(PARAMETER, pos)
            if start < 0:
                return out if not inner[pos:].strip() else None
            if inner[pos:start].strip():
                return None
            head_end = inner.find(">", start)
            key = inner[start + len(PARAMETER):head_end].strip() if head_end > 0 else ""
            if not _NAME.fullmatch(key):
                return None
            value_start = head_end + 1
            following = inner.find(PARAMETER, value_start)
            bound = len(inner) if following < 0 else following
            close = inner.find(PARAMETER_END, value_start, bound)  # (linear in the parameters)
            if close < 0:  # `</parameter>` left out: the value ends at the next parameter
                close = pos = bound
            else:
                pos = close + len(PARAMETER_END)
            value = inner[value_start:close]
            value = value[1:] if value.startswith("\n") else value
            out[key] = value[:-1] if value.endswith("\n") else value

    def _properties(self, name: str) -> dict[str, Any]:
        for tool in self.tools or []:
            function = tool.get("function", tool)
            if function.get("name") == name:
                return (function.get("parameters") or {}).get("properties") or {}
        return {}


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows ({} when it does not say)."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or [])
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            types |= schema_types(option)
    if "enum" in schema and not types:
        types = {type_name(v) for v in schema["enum"]}
    return types


def type_name(value: Any) -> str:
    for name, kind in (("boolean", bool), ("integer", int), ("number", float), ("string", str),
                       ("object", dict), ("array", list)):
        if isinstance(value, kind):
            return name
    return "null"


def typed_value(raw: str, schema: Any) -> Any:
    """A raw parameter value as the JSON value its schema asks for (module docstring)."""
    types = schema_types(schema)
    text = raw.strip()
    if "null" in types and text in ("null", "None"):
        return None
    if "string" in types:
        return raw
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    value = _json_or_literal(text, types)
    if value is _NOTHING:
        return raw
    kind = type_name(value)
    if not types or kind in types or (kind == "integer" and "number" in types):
        return value
    if kind == "number" and "integer" in types and value.is_integer():
        return int(value)
    return raw


_NOTHING = object()


def _json_or_literal(text: str, types: set[str]) -> Any:
    try:
        value = json.loads(text)
        if json.dumps(value, allow_nan=False):
            return value
    except (ValueError, RecursionError):
        pass
    if types & {"object", "array"} or not types:
        try:
            value = ast.literal_eval(text)  # a Python dict / list: literals only, never code
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return _NOTHING
        if isinstance(value, (dict, list)):
            try:
                return json.loads(json.dumps(value, allow_nan=False))
            except (TypeError, ValueError):
                return _NOTHING
    return _NOTHING


def parameters_grammar(schema: dict[str, Any]) -> str:
    """The Lark grammar of a call's parameters (module docstring) for a tool's `schema`."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        return ('start: param*\nparam[lazy]: "<parameter=" /[^\\s<>=]+/ ">\\n" /(.|\\n)*/ '
                '"</parameter>\\n"\n')
    definitions = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    required = set(schema.get("required") or ())
    rules, sequence = [], []
    for key, value in properties.items():
        if not _NAME.fullmatch(key):
            continue  # a name this format cannot write
        head = json.dumps(f"{PARAMETER}{key}>\n")
        i = len(rules)
        sequence.append(f"p{i}" if key in required else f"p{i}?")
        if "string" in schema_types(value) or not isinstance(value, dict):
            choices = value.get("enum") if isinstance(value, dict) else None
            if choices and all(isinstance(c, str) for c in choices):
                options = " | ".join(json.dumps(c) for c in choices)
                rules.append(f'p{i}: {head} ({options}) "\\n</parameter>\\n"')
            else:
                rules.append(f'p{i}[lazy]: {head} /(.|\\n)*/ "</parameter>\\n"')
        else:
            typed = json.dumps({**value, **definitions}, ensure_ascii=False)
            rules.append(f'p{i}: {head} %json {typed} "\\n</parameter>\\n"')
    if not rules:
        return 'start: ""\n'
    return "\n".join([f"start: {' '.join(sequence)}", *rules, ""])
