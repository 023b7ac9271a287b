"""What a chat template holds: plain data as itself, anything else `Opaque`; a string's `format`
method with each field's size checked (`FormatMethod`); and the helpers HF templates call
(`raise_exception`, `strftime_now`, `dict`, `namespace`, a plain-JSON `tojson`,
`{% generation %}`).

An opaque value (a function, method, class, iterator...) can be called, iterated and compared
through the sandbox, but turning it into text — rendering, `~`, `%`, `format`, `|string`,
`|tojson` — raises `SecurityError`: an object's repr, with its memory address, never reaches a
prompt or an error message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.runtime import LoopContext, Macro, Undefined
from jinja2.sandbox import SandboxedFormatter
from jinja2.utils import Namespace
from markupsafe import EscapeFormatter, Markup

from aserve.engine.template_limits import (
    Budget,
    TemplateLimitError,
    current,
    format_spec_width,
)

MAX_STRFTIME_CHARS = 1024  # strftime_now's format (a directive can expand 12-fold)

# What a template may hold as itself; anything else is wrapped in an `Opaque`.
PLAIN = (str, int, float, type(None), list, tuple, dict, set, frozenset, range, bytes,
         type({}.keys()), type({}.values()), type({}.items()), Undefined, Namespace,
         LoopContext, Macro)
_PLAIN_EXACT = frozenset({str, int, float, bool, type(None), list, tuple, dict})


class Opaque:
    """A function, method, class or other object a template may use but never see as text."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        raise SecurityError(refusal(self.value))

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        return self.__str__()

    def __eq__(self, other: object) -> bool:
        return self.value == unwrap(other)

    def __hash__(self) -> int:
        return hash(self.value)


class OpaqueCallable(Opaque):
    """Callable through the sandbox's `call` (which unwraps it); `is callable` holds."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise SecurityError("Chat templates call functions through the sandbox only.")


class OpaqueIterator(Opaque):
    """An iterator (a generator a filter returns...), iterated one tick per item."""

    __slots__ = ()

    def __iter__(self) -> Iterator[Any]:
        return iterate(self.value)


def refusal(value: Any) -> str:
    return (f"A chat template may render text, numbers, lists and dicts, not a "
            f"{type(unwrap(value)).__name__}.")


def unwrap(value: Any) -> Any:
    return value.value if isinstance(value, Opaque) else value


def sanitize(value: Any) -> Any:
    """`value` as a template may hold it: plain data as is, anything else wrapped."""
    if type(value) in _PLAIN_EXACT or isinstance(value, (PLAIN, Opaque)):
        return value
    if isinstance(value, Iterator):
        return OpaqueIterator(value)
    return OpaqueCallable(value) if callable(value) else Opaque(value)


def iterate(iterable: Any) -> Iterator[Any]:
    """`iterable`'s items, one tick each, at most `max_items` of them."""
    budget = current()
    limit = budget.limits.max_items
    for num, item in enumerate(unwrap(iterable)):
        budget.tick()
        if num >= limit:
            budget.check_items(num + 1)
        yield item


def materialize(budget: Budget, value: Any) -> Any:
    """An opaque iterator's items as a (checked) list; any other value as is."""
    if isinstance(value, OpaqueIterator):
        return budget.check_value(list(value))
    return value


# --------------------------------------------------------------------------------- str.format


class FormatMethod:
    """`text.format` / `text.format_map`, through a formatter that checks every field."""

    def __init__(self, environment: jinja2.Environment, text: str, is_map: bool) -> None:
        self.environment, self.text, self.is_map = environment, text, is_map

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        if self.is_map:
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one positional argument")
            args, kwargs = (), args[0]
        budget = current()
        text = self.text
        formatter = (_BoundedEscapeFormatter(self.environment, budget, escape=text.escape)
                     if isinstance(text, Markup) else _BoundedFormatter(self.environment, budget))
        return budget.built(type(text)(formatter.vformat(text, args, kwargs)))


class _BoundedFormatter(SandboxedFormatter):
    """jinja2's sandboxed `str.format`, each field's size predicted and charged."""

    def __init__(self, environment: jinja2.Environment, budget: Budget, **kwargs: Any) -> None:
        super().__init__(environment, **kwargs)
        self.budget = budget

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = self.budget
        budget.tick()
        budget.check_chars(budget.size_of(value) + format_spec_width(format_spec))
        text = super().format_field(value, format_spec)
        budget.charge(len(text))
        return text

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        self.budget.check_chars(self.budget.size_of(value))
        return super().convert_field(value, conversion)


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


# --------------------------------------------------------------------------------- HF's helpers


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class TemplateDict:
    """`dict(...)` for templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes, shown without its
    contents."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        super().__init__(attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace._check_name(name)
        super().__setitem__(name, value)

    def __repr__(self) -> str:
        return "<namespace>"

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"Chat templates may not set underscore-prefixed names, got {name!r}.")


def raise_exception(message: Any) -> None:
    raise TemplateError(message if isinstance(message, (str, int, float)) else
                        f"raise_exception() with a {type(unwrap(message)).__name__}")


def strftime_now(fmt: str) -> str:
    if isinstance(fmt, str) and len(fmt) > MAX_STRFTIME_CHARS:
        raise TemplateLimitError(f"strftime_now takes a format of at most {MAX_STRFTIME_CHARS} "
                                 "characters.")
    return datetime.now().strftime(fmt)


class _JSONEncoder(json.JSONEncoder):
    def default(self, o: Any) -> Any:
        raise TypeError(f"Object of type {type(unwrap(o)).__name__} is not JSON serializable")


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Plain JSON, as transformers' templates get it (jinja2's own tojson escapes HTML
    characters), made chunk by chunk and stopped once longer than `max_chars`."""
    budget = current()
    encoder = _JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                           sort_keys=sort_keys)
    chunks, size = [], 0
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        budget.check_chars(size, "JSON")
        chunks.append(chunk)
    return "".join(chunks)
