"""Chat templates: compiled and rendered as transformers' apply_chat_template does (the same immutable
jinja sandbox, options and helpers), within bounds of time and size.

A chat template is code that comes with a model: `{{ 'A' * 10**9 }}` or two nested loops of 10^5 steps
would hold a job for ever, or take all its memory, in one row. So a render stops (TemplateBoundError, a
TemplateError) past MAX_SECONDS, and no value it makes may weigh more than MAX_CHARS: a string its
length, a list or dict what its text would be, found by a walk that stops at the bound
(`_weight`). The checks sit where a template can make something big, before the value is made:

- the operators `*`, `**`, `+`, `%` (`call_binop`) and `~` (a `_jr_concat` filter the parse puts in);
- every call (`call`: a string's replace, join and expandtabs sized first, formats' widths) and every
  filter (each wrapped: indent sized first, integer arguments at most MAX_INT_ARG), arguments and
  results weighed;
- every `{% for %}` step and every call ticks the clock (`_Budget.tick`), in the render's own thread:
  no thread outlives a render, and a signal's handler runs between two steps;
- the output, counted as it is made (`render`), and each printed value (`finalize`).

Values within the bounds render exactly as transformers renders them: the checks return the values
unchanged, and the rewritten nodes compute what the originals did.
"""
from __future__ import annotations

import functools
import json
import re
import string
import time
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any, Iterator

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

MAX_CHARS = 16 << 20        # the largest string (or a container's text) a render may make, its output too
MAX_INT_ARG = 1 << 20       # the largest integer a call or filter may take (a width, a count)
MAX_INT_BITS = 1 << 16      # the largest integer `*` and `**` may make
MAX_SECONDS = 5.0           # a render's time (a usual one takes milliseconds)
MAX_JSON_INDENT = 64        # tojson's indent (it is multiplied by the depth on every line)

_SIZED_METHODS = ("replace", "join", "expandtabs")
_FORMAT_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%[^%a-zA-Z]*")


class TemplateBoundError(jinja2.exceptions.TemplateError):
    """A render went past a bound of time or size."""


class _Budget:
    """One render's clock."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBoundError(f"the chat template ran for more than {self.seconds:g} s")


_budget: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _tick() -> None:
    budget = _budget.get()
    if budget is not None:      # None: jinja folding constants at compile time
        budget.tick()


def _too_big(what: str) -> TemplateBoundError:
    return TemplateBoundError(f"the chat template makes {what} over {MAX_CHARS} characters")


def _weight(value: Any, limit: int = MAX_CHARS) -> int:
    """About how many characters `value` is as text (a string its length; a container its items and
    their separators); raises once past `limit`, so the walk is bounded by the limit, not the value."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v) + 2
        elif isinstance(v, dict):
            total += 2 + 2 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        else:
            total += 8
        if total > limit:
            raise _too_big("a value")
    return total


def _check(value: Any) -> Any:
    """value, once it is known to weigh at most MAX_CHARS (strings cost nothing to weigh)."""
    if isinstance(value, (str, bytes)):
        if len(value) > MAX_CHARS:
            raise _too_big("a string")
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        _weight(value)
    return value


def _check_args(args: tuple, kwargs: dict) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise TemplateBoundError(f"the chat template passes {a}, over {MAX_INT_ARG}, to a call")
        _check(a)


def _check_percent(fmt: str, args: Any) -> None:
    """`fmt % args` within the bounds: no width or precision past MAX_INT_ARG, in the format or given."""
    for spec in _PERCENT_SPEC.findall(fmt):
        if any(int(n) > MAX_INT_ARG for n in _FORMAT_NUMBER.findall(spec)):
            raise TemplateBoundError(f"the chat template formats with a width over {MAX_INT_ARG}")
    _check_args(args if isinstance(args, tuple) else (args,), {})


def _check_format(fmt: str) -> None:
    """str.format's widths within the bounds (those given as arguments are checked as arguments)."""
    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
    except ValueError:
        return      # str.format raises its own error
    if any(int(n) > MAX_INT_ARG for spec in specs for n in _FORMAT_NUMBER.findall(spec)):
        raise TemplateBoundError(f"the chat template formats with a width over {MAX_INT_ARG}")


def _check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """The arguments of text.<name>(...) once its result is known to fit (join's iterable as a list)."""
    if name == "join" and args:
        items = list(args[0])
        size = sum(len(i) for i in items if isinstance(i, str)) + len(text) * max(len(items) - 1, 0)
        args = (items, *args[1:])
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        n = text.count(old) if old else len(text) + 1
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        size = len(text) + n * (len(new) - len(old))
    elif name == "expandtabs":
        width = args[0] if args else kwargs.get("tabsize", 8)
        size = len(text) + text.count("\t") * (width if isinstance(width, int) else 8)
    else:
        return args
    if size > MAX_CHARS:
        raise _too_big("a string")
    return args


def _sized_binop(op: str, left: Any, right: Any) -> None:
    """Raise before `left op right` would pass a bound."""
    seqs = (str, bytes, list, tuple)
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*":
        if isinstance(left, seqs) and isinstance(right, int) or isinstance(right, seqs) and isinstance(left, int):
            seq, n = (left, right) if isinstance(left, seqs) else (right, left)
            if n > 0 and len(seq) * n > MAX_CHARS:
                raise _too_big("a repeated value")
        elif ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateBoundError(f"the chat template makes an integer over {MAX_INT_BITS} bits")
    elif op == "**" and ints and right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
        raise TemplateBoundError(f"the chat template makes an integer over {MAX_INT_BITS} bits")
    elif op == "+" and isinstance(left, seqs) and isinstance(right, seqs) and len(left) + len(right) > MAX_CHARS:
        raise _too_big("a joined value")
    elif op == "%" and isinstance(left, str):
        _check_percent(left, right)


def _concat(items: Any) -> str:
    """`a ~ b ~ c`, as jinja's own str_join makes it, sized first."""
    _tick()
    parts = [str(_check(i)) for i in items]
    if sum(map(len, parts)) > MAX_CHARS:
        raise _too_big("a joined string")
    return "".join(parts)


def _steps(iterable: Any) -> Iterator:
    """A {% for %}'s items, the clock ticked at each."""
    for item in iterable:
        _tick()
        yield item


class _BoundNodes(NodeTransformer):
    """Every `{% for %}` over `_jr_steps`, every `~` through `_jr_concat`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_jr_steps", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "_jr_concat", [], [], None, None,
                            lineno=node.lineno)


def _bounded_filter(name: str, f):
    """A filter whose arguments and result are within the bounds (indent, replace, join and format sized
    first)."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1    # the context, the value

    @functools.wraps(f)     # keeps jinja_pass_arg: jinja passes the context as it did
    def bounded(*args, **kwargs):
        _tick()
        value, rest = args[skip - 1] if len(args) >= skip else None, args[skip:]
        _check_args(rest, kwargs)
        if name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            width = len(width) if isinstance(width, str) else width
            if isinstance(width, int) and len(value) + (value.count("\n") + 1) * width > MAX_CHARS:
                raise _too_big("an indented string")
        elif name == "replace" and isinstance(value, str):
            _check_str_method(value, "replace", rest, kwargs)
        elif name == "join" and value is not None and not isinstance(value, str):
            value = list(value)
            _weight(value)
            args = (*args[:skip - 1], value, *rest)
        elif name == "format" and isinstance(value, str):
            _check_percent(value, rest or kwargs)
        _check(value)
        return _check(f(*args, **kwargs))
    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox (immutable, trim_blocks, lstrip_blocks, `generation` and loop controls)
    with the checks of the module's doc."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any):
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=_check,
                         extensions=[_GenerationBlock, loopcontrols], **kwargs)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters["_jr_steps"] = _steps
        self.filters["_jr_concat"] = _concat
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now

    def _parse(self, source, name, filename):
        return _BoundNodes().visit(super()._parse(source, name, filename))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        _sized_binop(operator, left, right)
        return _check(self.binop_table[operator](left, right))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's own names
        _tick()
        _check_args(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and getattr(__obj, "__name__", None) in _SIZED_METHODS:
            args = _check_str_method(owner, __obj.__name__, args, kwargs)
        elif isinstance(__obj, LoopContext) and args:      # a recursive loop's next level
            args = (_steps(args[0]), *args[1:])
        return _check(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any):
        wrapper = super().wrap_str_format(value)
        if wrapper is not None and isinstance(getattr(value, "__self__", None), str):
            _check_format(value.__self__)
        return wrapper


def compile_template(source: str) -> jinja2.Template:
    """The template compiled in a BoundedSandbox; jinja2.TemplateSyntaxError when it does not compile."""
    return BoundedSandbox().from_string(source)


def render(template: jinja2.Template, seconds: float = MAX_SECONDS, **variables: Any) -> str:
    """template.render(**variables) within the bounds: TemplateBoundError past one of them."""
    with _bounded(seconds):
        out, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > MAX_CHARS:
                raise TemplateBoundError(f"the chat template's output is over {MAX_CHARS} characters")
            out.append(chunk)
        return "".join(out)


@contextmanager
def _bounded(seconds: float):
    token = _budget.set(_Budget(seconds))
    try:
        yield
    finally:
        _budget.reset(token)


class _GenerationBlock(Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; render its body.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; transformers' does not
    width = len(indent) if isinstance(indent, str) else indent
    if isinstance(width, int) and width > MAX_JSON_INDENT:
        raise TemplateBoundError(f"the chat template's tojson indent is over {MAX_JSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)
