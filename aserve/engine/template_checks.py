"""The checks that run before a `str` method or a jinja2 filter in a chat template: each
predicts the size of what the call would build (`'x'.center(n)`, `replace`, `join`, `indent`,
`split`...) and refuses it, through the render's `Budget`, before anything is allocated.
`chat_template.py` calls them from the sandbox's `call` hook and from every filter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from aserve.engine.template_limits import (
    LINE_BREAKS,
    Budget,
    TemplateLimitError,
    count_chars,
    int_or_zero,
    percent_size,
    text_size,
)

ESCAPED = "&<>\"'"  # what markupsafe.escape() turns into 4- or 5-character entities
COSTLY_FILTER_MAX_CHARS = 256 << 10  # input of the pure-Python text filters (wordwrap, urlize...)
MAX_FORMAT_SPEC = 64  # characters of a tojson indent or separator


def escaped_size(value: Any, limit: int) -> int:
    """Characters of `markupsafe.escape(value)`."""
    if isinstance(value, str):
        return len(value) + 4 * count_chars(value, ESCAPED)
    return 5 * text_size(value, limit)


# --------------------------------------------------------------------------------- str methods


def call_str_method(budget: Budget, method: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
    """Call a method of a str (`method.__self__`) after predicting its result's size; the
    result is charged when it is a new string."""
    text, name = method.__self__, method.__name__
    if name in ("split", "rsplit"):
        return _split(budget, method, *args, **kwargs)
    check = STR_METHOD_CHECKS.get(name)
    if check is not None:
        check(budget, text, *args, **kwargs)
    result = method(*args, **kwargs)
    if isinstance(result, (str, bytes)):
        return budget.built(result)
    return budget.check_value(result)


def _split(budget: Budget, method: Callable[..., list[str]], sep: Any = None,
           maxsplit: int = -1) -> list[str]:
    """`str.split` / `rsplit`, never making more than `max_items` + 1 pieces."""
    limit = budget.limits.max_items
    if isinstance(maxsplit, int) and 0 <= maxsplit < limit:
        return method(sep, maxsplit)
    parts = method(sep, limit)
    budget.check_items(len(parts))  # max_items + 1 pieces: the split may have stopped short
    return parts


def _check_width(budget: Budget, text: str, width: Any = 0, *_: Any) -> None:
    budget.check_chars(max(len(text), int_or_zero(width)))


def _check_replace(budget: Budget, text: str, old: Any = "", new: Any = "",
                   count: Any = -1) -> None:
    if not (isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return
    num = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        num = min(num, count)
    budget.check_chars(len(text) + num * (len(new) - len(old)))


def _check_expandtabs(budget: Budget, text: str, tabsize: Any = 8) -> None:
    budget.check_chars(len(text) + text.count("\t") * int_or_zero(tabsize))


def _check_translate(budget: Budget, text: str, table: Any = None) -> None:
    if isinstance(table, Mapping):
        longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
        budget.check_chars(len(text) * longest)


def _check_splitlines(budget: Budget, text: str, *_: Any) -> None:
    budget.check_items(count_chars(text, LINE_BREAKS) + 1)


def _check_join(budget: Budget, sep: str, items: Any = ()) -> None:
    if isinstance(items, (list, tuple)):
        budget.check_items(len(items))
        size = sum(len(item) if isinstance(item, str) else 0 for item in items)
        budget.check_chars(size + len(sep) * max(len(items) - 1, 0))


STR_METHOD_CHECKS: dict[str, Callable[..., None]] = {
    "center": _check_width, "ljust": _check_width, "rjust": _check_width,
    "zfill": _check_width, "replace": _check_replace, "expandtabs": _check_expandtabs,
    "translate": _check_translate, "splitlines": _check_splitlines, "join": _check_join,
}


# --------------------------------------------------------------------------------- filters


def _join_size(value: Any, d: Any, limit: int) -> int:
    """Characters of `value|join(d)` at most (an attribute of an item is no longer than it)."""
    separator = len(d) if isinstance(d, str) else 0
    if isinstance(value, str):
        return len(value) * (1 + separator)
    items = value if isinstance(value, (list, tuple, range)) else list(value)
    size = separator * max(len(items) - 1, 0)
    for item in items:
        size += len(item) if isinstance(item, str) else text_size(item, limit)
        if size > limit:
            break
    return size


def _filter_join(budget: Budget, value: Any, d: Any = "", attribute: Any = None) -> None:
    budget.check_chars(_join_size(value, d, budget.limits.max_chars))


def _filter_center(budget: Budget, value: Any, width: Any = 80) -> None:
    budget.check_chars(budget.size_of(value) + int_or_zero(width))


def _filter_indent(budget: Budget, s: Any, width: Any = 4, first: Any = False,
                   blank: Any = False) -> None:
    if isinstance(s, str):
        lines = count_chars(s, LINE_BREAKS) + 2
        budget.check_items(lines)
        width = len(width) if isinstance(width, str) else int_or_zero(width)
        budget.check_chars(len(s) + lines * width)


def _filter_replace(budget: Budget, s: Any, old: Any = "", new: Any = "",
                    count: Any = None) -> None:
    if isinstance(s, str):
        _check_replace(budget, s, old, new, -1 if count is None else count)


def _filter_format(budget: Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        budget.check_chars(percent_size(value, kwargs or args, budget.limits.max_chars))


def _filter_batch(budget: Budget, value: Any, linecount: Any = 0,
                  fill_with: Any = None) -> None:
    budget.check_items(int_or_zero(linecount))
    budget.check_chars(budget.size_of(fill_with) * int_or_zero(linecount),
                       "a list (as text)")


def _filter_slice(budget: Budget, value: Any, slices: Any = 0, fill_with: Any = None) -> None:
    budget.check_items(int_or_zero(slices))


def _filter_sum(budget: Budget, iterable: Any, attribute: Any = None, start: Any = 0) -> None:
    if not isinstance(start, (int, float)):
        raise TemplateLimitError("In a chat template, `sum` adds numbers only.")


def _filter_list(budget: Budget, value: Any) -> None:
    if isinstance(value, str):
        budget.check_items(len(value))


def _filter_escape(budget: Budget, value: Any) -> None:
    budget.check_chars(escaped_size(value, budget.limits.max_chars))


def _filter_wordwrap(budget: Budget, s: Any, width: Any = 79, break_long_words: Any = True,
                     wrapstring: Any = None, break_on_hyphens: Any = True) -> None:
    if isinstance(s, str):
        lines = (len(s) // max(int_or_zero(width), 1) + s.count(" ")
                 + count_chars(s, LINE_BREAKS) + 1)
        wrap = len(wrapstring) if isinstance(wrapstring, str) else 1
        budget.check_chars(len(s) + lines * wrap)


def _filter_tojson(budget: Budget, value: Any, ensure_ascii: Any = False, indent: Any = None,
                   separators: Any = None, sort_keys: Any = False) -> None:
    parts = [indent] if isinstance(indent, str) else []
    parts += [s for s in separators or () if isinstance(s, str)]
    if int_or_zero(indent) > MAX_FORMAT_SPEC or any(len(p) > MAX_FORMAT_SPEC for p in parts):
        raise TemplateLimitError(f"In a chat template, a tojson indent or separator is at most "
                                 f"{MAX_FORMAT_SPEC} characters.")


# Checks run before a filter, with the filter's own arguments.
FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "join": _filter_join, "center": _filter_center, "indent": _filter_indent,
    "replace": _filter_replace, "format": _filter_format, "batch": _filter_batch,
    "slice": _filter_slice, "sum": _filter_sum, "list": _filter_list, "e": _filter_escape,
    "escape": _filter_escape, "forceescape": _filter_escape, "wordwrap": _filter_wordwrap,
    "tojson": _filter_tojson,
}
# Filters that take their input lazily, item by item; any other filter gets an iterator's
# items as a list (counted, and checked like any list).
LAZY_FILTERS = frozenset({"map", "select", "reject", "selectattr", "rejectattr", "first",
                          "items"})
# Filters that return one of the values they were given (never a new string or list).
SELECTING_FILTERS = frozenset({"first", "last", "random", "default", "d", "attr", "min",
                               "max"})
# Filters that build new text: their result is charged to the render's budget.
BUILDING_FILTERS = frozenset({
    "capitalize", "center", "e", "escape", "forceescape", "filesizeformat", "format", "indent",
    "join", "lower", "pprint", "replace", "reverse", "safe", "string", "striptags", "title",
    "tojson", "trim", "truncate", "upper", "urlencode", "urlize", "wordwrap", "xmlattr"})
# Pure-Python text filters, slow per character: their input is at most COSTLY_FILTER_MAX_CHARS.
COSTLY_FILTERS = frozenset({"pprint", "striptags", "urlize", "urlencode", "wordcount",
                            "wordwrap", "xmlattr"})
