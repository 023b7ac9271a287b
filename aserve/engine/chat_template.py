"""Chat templates: compiled once (`TemplateCache`), rendered by `render` in a hardened jinja2
sandbox, within `RenderLimits` (`template_limits.py`).

Every template renders here — the model's, `--chat-template`'s and a request's own — with the
globals and filters HF templates expect (`raise_exception`, `strftime_now`, a plain-JSON
`tojson`, `{% generation %}`, loop controls). On top of jinja2's `ImmutableSandboxedEnvironment`
(no Python internals, no mutation of lists and dicts):

- *Sizes are predicted before anything is built.* Operators, filters, `str` methods, `~`,
  literals and the output go through hooks that refuse a result over the limits before it is
  allocated, and charge what a render builds. Constant folding is off (`optimized=False`, and a
  `finalize` that takes the context), so compiling a template computes nothing.
- *Time is bounded*: every loop iteration, call, attribute, operator, filter and output ticks
  the render's clock. A single C-level operation is not interrupted, but none can be larger
  than the size limits allow.
- *No object reprs*: functions, methods, classes and iterators reach a template only wrapped
  (`Opaque`); it may call or iterate them but never turn them into text, so no memory address
  reaches a prompt or an error message.

It is not a process boundary. Whether clients may send templates at all is the server's call
(`--trust-request-chat-template`, `aserve/server/chat.py`).
"""

from __future__ import annotations

import re
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.runtime import Context, LoopContext, Undefined, markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Cycler, Joiner, _PassArg

from aserve.engine import template_limits
from aserve.engine.template_checks import (
    BUILDING_FILTERS,
    COSTLY_FILTER_MAX_CHARS,
    COSTLY_FILTERS,
    FILTER_CHECKS,
    LAZY_FILTERS,
    SELECTING_FILTERS,
    call_str_method,
)
from aserve.engine.template_limits import (
    RenderLimits,
    TemplateLimitError,
    budgeted,
    check_binop,
    current,
    text_size,
)
from aserve.engine.template_values import (
    FormatMethod,
    GenerationTag,
    TemplateDict,
    TemplateNamespace,
    iterate,
    materialize,
    raise_exception,
    refusal,
    sanitize,
    strftime_now,
    tojson,
    unwrap,
)

MAX_REQUEST_TEMPLATE_BYTES = 64 << 10  # a request's own template (HF templates: 1-20 KB)
TEMPLATE_CACHE_BYTES = 2 << 20  # compiled templates kept, by the sum of their sources' sizes
MAX_ERROR_CHARS = 2000  # of an error's description

# What `{{ ... }}` may render (a container's items are plain or opaque, never raw objects).
_RENDERABLE = (str, int, float, type(None), list, tuple, dict, Undefined)
_ADDRESS = re.compile(r"\s+at 0x[0-9A-Fa-f]+")  # an object's default repr, ...
_REPR = re.compile(r"<(?:built-in|bound|method|function|class|module|generator|[\w.]+ object)"
                   r"\b[^<>]*>")  # ... and the reprs of functions and their like


def render(source: str, limits: RenderLimits | None = None, **variables: Any) -> str:
    """Render the template `source` with `variables`, within `limits` (default:
    `template_limits.DEFAULT_LIMITS`). Raises `jinja2.TemplateError` (`TemplateLimitError`
    past a limit) or whatever the template's own operations raise."""
    template = TEMPLATES.get(source)
    with budgeted(limits or template_limits.DEFAULT_LIMITS):
        return template.render(**variables)


def describe_error(error: BaseException) -> str:
    """`error` for a client: its type and message, object reprs and memory addresses removed,
    at most MAX_ERROR_CHARS characters."""
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - a message that cannot be shown (an opaque value's)
        message = ""
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return _REPR.sub("<object>", _ADDRESS.sub("", text))[:MAX_ERROR_CHARS]


# --------------------------------------------------------------------------------- the cache


class TemplateCache:
    """Compiled templates by source, least recently used evicted first, holding at most
    `max_bytes` of sources (UTF-8). A source larger than that is compiled and not kept."""

    def __init__(self, environment: jinja2.Environment, max_bytes: int) -> None:
        self.environment = environment
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[jinja2.Template, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, source: str) -> jinja2.Template:
        with self._lock:
            entry = self._entries.get(source)
            if entry is not None:
                self._entries.move_to_end(source)
                return entry[0]
        template = self.environment.from_string(source)
        size = len(source.encode("utf-8", "surrogatepass"))
        if size <= self.max_bytes:
            with self._lock:
                self._add(source, template, size)
        return template

    def _add(self, source: str, template: jinja2.Template, size: int) -> None:
        if source in self._entries:
            return
        self._entries[source] = (template, size)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.num_bytes -= evicted

    def check_invariants(self) -> None:
        assert self.num_bytes == sum(size for _, size in self._entries.values())
        assert self.num_bytes <= self.max_bytes


# --------------------------------------------------------------------------------- the compiler


class _CodeGenerator(CodeGenerator):
    """jinja2's code generator with what no sandbox hook sees routed through the environment:
    loops (each iteration ticks), `~` and literals (sizes checked), slices (copies charged)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iterables: set[int] = set()  # ids of the For nodes' `iter` expressions

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._loop_iterables:
            return super().visit(node, *args, **kwargs)
        self.write("environment.iterate(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        self._loop_iterables.add(id(node.iter))
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        markup = ("context.eval_ctx.autoescape" if frame.eval_ctx.volatile
                  else str(bool(frame.eval_ctx.autoescape)))
        self.write("environment.concat_parts((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write(f"), {markup})")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._literal(super().visit_List, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # an assignment target
            return super().visit_Tuple(node, frame)
        self._literal(super().visit_Tuple, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._literal(super().visit_Dict, node, frame)

    def _literal(self, visit: Callable[..., None], node: nodes.Expr, frame: Frame) -> None:
        self.write("environment.literal(")
        visit(node, frame)
        self.write(")")

    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        if not isinstance(node.arg, nodes.Slice):
            return super().visit_Getitem(node, frame)
        self.write("environment.getitem(")
        self.visit(node.node, frame)
        self.write(", slice(")
        for num, part in enumerate((node.arg.start, node.arg.stop, node.arg.step)):
            self.write(", " if num else "")
            if part is None:
                self.write("None")
            else:
                self.visit(part, frame)
        self.write("))")


# --------------------------------------------------------------------------------- environment


class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with HF's globals and filters, bounded by the render's
    `Budget` at every hook (see the module docstring)."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, optimized=False,
                         finalize=_finalize,
                         extensions=[GenerationTag, jinja2.ext.loopcontrols])
        filters = {**self.filters, "tojson": tojson}
        self.filters = {name: _bounded_filter(name, f) for name, f in filters.items()}
        self.globals = {name: sanitize(value) for name, value in {
            "range": safe_range, "dict": TemplateDict(), "namespace": TemplateNamespace,
            "cycler": Cycler, "joiner": Joiner, "raise_exception": raise_exception,
            "strftime_now": strftime_now}.items()}

    # ---- sandbox hooks

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = current()
        budget.tick()
        if operator == "+" and type(left) is str and type(right) is str:  # the common case
            return budget.built_size(len(left) + len(right)) and left + right
        list_size = check_binop(budget, operator, left, right)
        result = self.binop_table[operator](left, right)
        if isinstance(result, (str, bytes)):
            return budget.built(result)
        if list_size is not None and isinstance(result, (list, tuple)):
            budget.charge(len(result))
            budget.check_container_size(result, list_size)
            return result
        return budget.check_value(result)

    def getattr(self, obj: Any, attribute: str) -> Any:
        current().tick()
        if type(obj) is dict and attribute in obj and not hasattr(dict, attribute):
            return sanitize(obj[attribute])  # `message.role`: what jinja2 finds, sooner
        return sanitize(super().getattr(unwrap(obj), attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = current()
        budget.tick()
        value = super().getitem(unwrap(obj), argument)
        if isinstance(argument, slice) and isinstance(value, (str, bytes, list, tuple)):
            budget.charge(len(value))  # a copy
        return sanitize(value)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = current()
        budget.tick()
        obj = unwrap(__obj)
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str) and isinstance(obj, (types.BuiltinMethodType,
                                                       types.MethodType)):
            kwargs.pop("_loop_vars", None)
            kwargs.pop("_block_vars", None)
            if obj.__name__ == "join" and args:
                args = (materialize(budget, args[0]), *args[1:])
            return sanitize(call_str_method(budget, obj, args, kwargs))
        if isinstance(obj, LoopContext) and args:  # a recursive loop's `loop(children)`
            args = (__self.iterate(args[0]), *args[1:])
        values = (*args, *(v for k, v in kwargs.items() if not k.startswith("_")))
        budget.check_chars(sum(map(budget.measure, values)), "arguments (as text)")
        result = super().call(__context, obj, *args, **kwargs)
        if not isinstance(owner, (dict, list, tuple)):  # their methods return what they hold
            budget.check_value(result)
        return sanitize(result)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if (isinstance(value, (types.BuiltinMethodType, types.MethodType))
                and value.__name__ in ("format", "format_map")
                and isinstance(value.__self__, str)):
            return FormatMethod(self, value.__self__, value.__name__ == "format_map")
        return None

    # ---- called by the generated code (`_CodeGenerator`)

    def iterate(self, iterable: Any) -> Iterator[Any]:
        return iterate(iterable)

    def literal(self, value: Any) -> Any:
        budget = current()
        budget.tick()
        return budget.check_value(value)

    def concat_parts(self, parts: tuple, markup: bool) -> str:
        """`a ~ b ~ ...`"""
        budget = current()
        budget.tick()
        budget.check_chars(sum(len(p) if isinstance(p, str) else budget.size_of(p)
                               for p in parts))
        return budget.built(markup_join(parts) if markup else "".join(map(str, parts)))

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Joins a render's output, and each macro's, block's and `{% set %}` block's: stops
        as soon as it would exceed `max_chars`."""
        budget = current()
        limit = budget.limits.max_chars
        kept, size = [], 0
        for piece in pieces:
            budget.tick()
            size += len(piece)
            if size > limit:
                budget.check_chars(size, "text")
            kept.append(piece)
        return budget.built("".join(kept))


@pass_context
def _finalize(context: Context, value: Any) -> Any:
    """What `{{ value }}` outputs: text, numbers, lists and dicts only. (Taking the context
    also stops jinja2 from rendering constants while compiling.)"""
    budget = current()
    budget.tick()
    if isinstance(value, str):
        return value
    if not isinstance(value, _RENDERABLE):
        raise SecurityError(refusal(value))
    if isinstance(value, (list, tuple, dict)):
        budget.charge(budget.size_of(value))
    return value


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` (a jinja2 filter) with its input materialized, checked, and its result charged."""
    pass_arg = _PassArg.from_obj(func)
    check = FILTER_CHECKS.get(name)
    lead: Callable[[Context], tuple] = {
        _PassArg.context: lambda context: (context,),
        _PassArg.eval_context: lambda context: (context.eval_ctx,),
        _PassArg.environment: lambda context: (context.environment,),
    }.get(pass_arg, lambda context: ())

    @pass_context
    def bounded(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.tick()
        if name not in LAZY_FILTERS:
            value = materialize(budget, value)
        if name in COSTLY_FILTERS and text_size(value, COSTLY_FILTER_MAX_CHARS) > \
                COSTLY_FILTER_MAX_CHARS:
            raise TemplateLimitError(f"In a chat template, `{name}` takes at most "
                                     f"{COSTLY_FILTER_MAX_CHARS} characters.")
        if check is not None:
            check(budget, value, *args, **kwargs)
        result = func(*lead(context), value, *args, **kwargs)
        if name in SELECTING_FILTERS:
            return sanitize(result)
        if isinstance(result, str) and name in BUILDING_FILTERS:
            return budget.built(result)
        return sanitize(budget.check_value(result))

    return bounded


ENVIRONMENT = ChatTemplateEnvironment()
TEMPLATES = TemplateCache(ENVIRONMENT, TEMPLATE_CACHE_BYTES)
