"""What one chat template render may build, and for how long: `RenderLimits`, the per-render
`Budget` (a deadline, the characters built so far, the sizes of recent lists), text-size
estimates, and the predictions for operators (`'x' * n`, `l + l`, `2 ** n`, `'%999s' % x`) and
`str.format` widths, checked before the operation runs so that nothing over a limit is ever
allocated. Only bookkeeping over Python values: `chat_template.py` calls it from jinja2's
sandbox hooks; `template_checks.py` holds the predictions for `str` methods and filters.

A render's budget is found through a context variable (`current()`), set by `budgeted()`
around one render: some sandbox hooks (`getattr`, `getitem`) receive no template context.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines() splits on
NUM_REMEMBERED_SIZES = 8  # recent lists and dicts whose text size a budget remembers


@dataclass(frozen=True)
class RenderLimits:
    """Bounds on one render of a chat template. Sizes are in characters (a str's `len`); a
    list's or dict's size is the length of its text (`str()` / JSON), counted without escapes.

    The defaults let anything a maximal request body (16 MiB) carries render, twice over."""

    max_chars: int = 32 << 20  # one string or list a template builds; the rendered text
    max_built_chars: int = 128 << 20  # all the strings one render builds, together
    max_items: int = 1 << 20  # one list or dict a template builds; one loop's iterations
    max_int_bits: int = 1 << 16  # one integer a template computes
    max_seconds: float = 5.0  # wall clock, checked at every 32nd loop step, call or operator


DEFAULT_LIMITS = RenderLimits()


class TemplateLimitError(TemplateError):
    """A render went past one of its `RenderLimits`."""


class Budget:
    """One render's account: its deadline and the characters it has built so far."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds
        self.num_built_chars = 0
        self.num_ticks = 0
        # id -> (container, its text size): a template cannot change a list or dict, so a list
        # grown item by item (`ns.l = ns.l + [x]`) is sized in O(1) per step, not O(length)
        self._sizes: OrderedDict[int, tuple[Any, int]] = OrderedDict()

    def tick(self) -> None:
        """One step: a loop iteration, call, attribute, operator, filter or output."""
        self.num_ticks += 1
        if not self.num_ticks & 31 and time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"The chat template ran for more than {self.limits.max_seconds:g} s.")

    def check_chars(self, num_chars: int, what: str = "a string") -> None:
        if num_chars > self.limits.max_chars:
            raise TemplateLimitError(f"The chat template would build {what} longer than "
                                     f"{self.limits.max_chars} characters.")

    def check_items(self, num_items: int) -> None:
        if num_items > self.limits.max_items:
            raise TemplateLimitError(f"The chat template would build or iterate over more "
                                     f"than {self.limits.max_items} items.")

    def check_int(self, num_bits: int) -> None:
        if num_bits > self.limits.max_int_bits:
            raise TemplateLimitError(f"The chat template would compute an integer of more "
                                     f"than {self.limits.max_int_bits} bits.")

    def charge(self, num_chars: int) -> None:
        self.num_built_chars += num_chars
        if self.num_built_chars > self.limits.max_built_chars:
            raise TemplateLimitError(f"The chat template built more than "
                                     f"{self.limits.max_built_chars} characters in all.")

    def built_size(self, num_chars: int) -> bool:
        """A new string of `num_chars` is about to be built: check and charge it. True."""
        if num_chars > self.limits.max_chars:
            self.check_chars(num_chars)
        self.num_built_chars += num_chars
        if self.num_built_chars > self.limits.max_built_chars:
            self.charge(0)
        return True

    def built(self, text: str) -> str:
        """`text` is new: check its size and charge it."""
        self.check_chars(len(text))
        self.charge(len(text))
        return text

    def check_value(self, value: Any) -> Any:
        """A value a template obtained: a list or dict within the limits, an int within its
        bits. Strings are checked where they are built (`built`)."""
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            self.check_items(len(value))
            self.check_container_size(value, self.size_of(value))
        elif isinstance(value, int):
            self.check_int(value.bit_length())
        return value

    def check_container_size(self, value: Any, size: int) -> None:
        """A list or dict of text size `size`: within the limit, and remembered."""
        self.check_chars(size, "a list or dict (as text)")
        self._sizes[id(value)] = (value, size)
        self._sizes.move_to_end(id(value))
        if len(self._sizes) > NUM_REMEMBERED_SIZES:
            self._sizes.popitem(last=False)

    def size_of(self, value: Any) -> int:
        """`text_size(value)`, reusing what is remembered of the lists and dicts in it."""
        return text_size(value, self.limits.max_chars, self._sizes)

    def measure(self, value: Any) -> int:
        """`size_of(value)`, remembered if `value` is a list or dict."""
        size = self.size_of(value)
        if isinstance(value, (list, tuple, dict)):
            self.check_container_size(value, size)
        return size


_CURRENT: contextvars.ContextVar[Budget] = contextvars.ContextVar("chat_template_budget")


@contextlib.contextmanager
def budgeted(limits: RenderLimits) -> Iterator[Budget]:
    """A fresh budget for the render run inside the `with` block."""
    token = _CURRENT.set(Budget(limits))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def current() -> Budget:
    try:
        return _CURRENT.get()
    except LookupError:
        raise RuntimeError("Chat templates render through aserve.engine.chat_template.render, "
                           "which gives each render its budget.") from None


# --------------------------------------------------------------------------------- sizes


def text_size(value: Any, limit: int, known: Mapping[int, tuple[Any, int]] | None = None) -> int:
    """About how many characters `str()`, `repr()` or JSON of `value` takes (escapes not
    counted); counting stops once past `limit`. A shared reference counts each time, as its
    text repeats. `known`: id -> (container, size) already measured."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item) + 2
        elif known and id(item) in known and known[id(item)][0] is item:
            total += known[id(item)][1]
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            if total <= limit:
                stack.extend(item.keys())
                stack.extend(item.values())
        elif isinstance(item, int):
            total += item.bit_length() * 3 // 10 + 2
        else:  # None, a float, an Undefined, a namespace: short texts, or no text at all
            total += 24
    return total


def int_or_zero(value: Any) -> int:
    return value if isinstance(value, int) else 0


def count_chars(text: str, chars: str) -> int:
    return sum(text.count(c) for c in chars)


def percent_size(template: str, args: Any, limit: int) -> int:
    """Characters of `template % args` at most: its text, each conversion's value and widths."""
    values = args if isinstance(args, tuple) else (args,)
    total, i, pos = len(template), 0, template.find("%")
    while pos >= 0 and total <= limit:
        spec, pos = _percent_spec(template, pos + 1)
        key, width, precision, conversion = spec
        if conversion == "%":
            pos = template.find("%", pos)
            continue
        if width == "*":
            width, i = (abs(values[i]) if i < len(values) and isinstance(values[i], int)
                        else 0), i + 1
        if precision == "*":
            precision, i = (values[i] if i < len(values) and isinstance(values[i], int)
                            else 0), i + 1
        if key is not None:
            value = args.get(key) if isinstance(args, Mapping) else None
        else:
            value, i = (values[i] if i < len(values) else None), i + 1
        total += int_or_zero(width) + int_or_zero(precision) + (
            text_size(value, limit) if conversion in "sra" else 330)  # a float's digits
        pos = template.find("%", pos)
    return total


def _percent_spec(template: str, pos: int) -> tuple[tuple[Any, Any, Any, str], int]:
    """Parse one conversion after its `%`: (mapping key, width, precision, conversion char)."""
    key = None
    if template.startswith("(", pos):
        end = template.find(")", pos)
        end = len(template) - 1 if end < 0 else end
        key, pos = template[pos + 1:end], end + 1
    while pos < len(template) and template[pos] in "#0- +":
        pos += 1
    width, pos = _percent_number(template, pos)
    precision: Any = None
    if template.startswith(".", pos):
        precision, pos = _percent_number(template, pos + 1)
    while pos < len(template) and template[pos] in "hlL":
        pos += 1
    return (key, width, precision, template[pos:pos + 1]), pos + 1


def _percent_number(template: str, pos: int) -> tuple[Any, int]:
    if template.startswith("*", pos):
        return "*", pos + 1
    end = pos
    while end < len(template) and template[end].isdigit():
        end += 1
    digits = template[pos:end]
    return (int(digits) if 0 < len(digits) < 20 else (1 << 62 if digits else 0)), end


def format_spec_width(spec: str) -> int:
    """The sum of the numbers (width, precision) in a `str.format` spec such as `>{w}.3`."""
    numbers, digits = 0, ""
    for char in spec + " ":
        if char.isdigit():
            digits += char
        elif digits:
            numbers += int(digits) if len(digits) < 20 else 1 << 62
            digits = ""
    return numbers


# --------------------------------------------------------------------------------- operators


def check_binop(budget: Budget, operator: str, left: Any, right: Any) -> int | None:
    """Refuse `left <operator> right` before it runs if its result would be too large; the
    text size of the list it makes, if it makes one."""
    if operator == "*":
        if isinstance(left, int) and not isinstance(right, int):
            left, right = right, left
        if isinstance(left, (str, bytes)) and isinstance(right, int):
            budget.check_chars(len(left) * right)
        elif isinstance(left, (list, tuple)) and isinstance(right, int):
            budget.check_items(len(left) * right)
            budget.check_chars(budget.size_of(left) * right, "a list (as text)")
            return budget.size_of(left) * max(right, 0)
        elif isinstance(left, int) and isinstance(right, int):
            budget.check_int(left.bit_length() + right.bit_length())
    elif operator == "+":
        if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            budget.check_chars(len(left) + len(right))
        elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            budget.check_items(len(left) + len(right))
            size = budget.size_of(left) + budget.size_of(right)
            budget.check_chars(size, "a list (as text)")
            return size
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            budget.check_int(left.bit_length() * right)
    elif operator == "%" and isinstance(left, str):
        budget.check_chars(percent_size(left, right, budget.limits.max_chars))
    return None
