"""Chat templates: untrusted jinja2 programs from the model's author, rendered the way
transformers renders them (same options, same helpers) but only inside jinja2's
ImmutableSandboxedEnvironment, which refuses access to Python internals, and under limits
on what one render may cost (see `TemplateLimits`): a template that loops or recurses
without end, or builds gigabytes of text, is stopped with a one-line TokenizerError
instead of hanging or exhausting memory.

Bounded by construction, not only between steps: every filter, method and global is
charged the items it will go through before it runs (a sort of n items n·log2 n steps), and
every string, list or printed value is sized before it is built (a join, a format, a
`{{ value }}` of a list holding one string a thousand times), so no single call can run
long or allocate much inside one step. Templates too large, or nested too deeply for
jinja2's parser or Python's compiler, are refused in one line before they are compiled.

A special token the template uses (`bos_token`, ...) that tokenizer_config.json does not
define is an error when the template prints it, rather than silently rendering as ""
(transformers' behaviour, which drops the BOS a model may need): `{% if bos_token %}`
and `bos_token is defined` still test it safely.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import math
import re
import time
from collections.abc import Iterator, Mapping, Set
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.nodes as jnodes
import jinja2.sandbox
from jinja2.ext import loopcontrols

from twice.core.errors import TokenizerError, TwiceError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateLimits:
    """What one chat-template render may cost. Real templates stay far below: a loop
    over the messages and a few string operations per message."""

    steps = 1_000_000  # loop iterations, calls (macros, methods, filters) and the items calls go through
    seconds = 5.0  # wall time of one render
    items = 16 * 2**20  # characters of any one string built (items of a list), and of the output
    total = 256 * 2**20  # characters and items of everything one render builds, together
    width = 10_000  # a field width in a format string ('%20s', '{:>20}')
    int_bits = 65_536  # integers a template computes (2**65536 is already 19,729 digits)
    lipsum_words = 10_000
    source = 2**20  # characters of the template itself (real ones: a few thousand)
    nesting = 32  # blocks inside blocks, brackets inside brackets (real templates: under 10)
    operators = 200  # operators and filters in one expression
    depth = 64  # lists inside lists (dicts, ...) of a value printed or serialized


class TemplateLimitError(TokenizerError):
    """A chat template went past one of TemplateLimits."""


_BUDGET: contextvars.ContextVar = contextvars.ContextVar("twice_template_budget", default=None)
_LOOP_NAME = "_twice_loop"  # the names the compiled template calls; templates may not use them
_CONCAT_NAME = "_twice_concat"


class _Budget:
    def __init__(self):
        self.deadline = time.monotonic() + TemplateLimits.seconds
        self.steps = 0
        self.built = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > TemplateLimits.steps:
            raise TemplateLimitError(f"chat template stopped: more than {TemplateLimits.steps:,} loop iterations "
                                     "and calls in one render (does it loop without end?)")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"chat template stopped: rendering took longer than {TemplateLimits.seconds:g} s")

    def charge(self, work: int, what: str) -> None:
        """Count `work` steps for a call before it runs (items it goes through)."""
        self.steps += work
        if self.steps > TemplateLimits.steps:
            raise TemplateLimitError(f"chat template stopped: {what} ({work:,} steps) would take the render past "
                                     f"{TemplateLimits.steps:,} steps (loop iterations, calls and the items they "
                                     "go through)")
        self.step()

    def build(self, size: int) -> None:
        self.built += size
        if self.built > TemplateLimits.total:
            raise TemplateLimitError(f"chat template stopped: it built more than {TemplateLimits.total:,} "
                                     "characters and items in all")


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.step()


def _charge(work: int, what: str) -> None:
    budget = _BUDGET.get()
    if budget is not None and work > 0:
        budget.charge(work, what)


def _sort_work(n: int) -> int:
    return n * max(1, n.bit_length())


def _too_big(what: str, size) -> TemplateLimitError:
    return TemplateLimitError(f"chat template stopped: {what} of {size:,} would exceed the limit of "
                              f"{TemplateLimits.items:,}")


def _check_items(size: int, what: str = "a string or list") -> None:
    if size > TemplateLimits.items:
        raise _too_big(what, size)


def _checked(result):
    if isinstance(result, (str, list, tuple, dict, bytes, set, frozenset)):
        _check_items(len(result))
        budget = _BUDGET.get()
        if budget is not None:
            budget.build(len(result))
    return result


def _printed_size(value, what: str = "a printed value", depth: int = 0, seen: frozenset = frozenset()) -> int:
    """About len(str(value)) (exact for a string), found without building it: a list of
    one long string a thousand times is counted before str() or json.dumps builds it. The
    walk counts its items as steps and stops past TemplateLimits.items. (repr and JSON may
    escape characters, so the real size can be a few times more; the result is checked
    again once built.)"""
    if isinstance(value, str):
        return len(value)
    if value is None or isinstance(value, (bool, float)):
        return 24
    if isinstance(value, int):
        return value.bit_length() * 3 // 10 + 2
    if isinstance(value, (bytes, bytearray)):
        return 4 * len(value) + 3
    if depth > TemplateLimits.depth:
        raise TemplateLimitError(f"chat template stopped: a value nested more than {TemplateLimits.depth} deep")
    if isinstance(value, jinja2.utils.Namespace):
        value = object.__getattribute__(value, "_Namespace__attrs")
    if isinstance(value, Mapping):
        children = [c for pair in value.items() for c in pair]
    elif isinstance(value, (list, tuple, Set, type({}.keys()), type({}.values()), type({}.items()))):
        children = list(value)
    else:  # macros, loops, cyclers, generators, ranges, Undefined: short reprs
        return 64
    if id(value) in seen:
        return 8
    _charge(len(children), "printing a value")
    seen = seen | {id(value)}
    total = 2
    for child in children:
        total += _printed_size(child, what, depth + 1, seen) + 4
        if total > TemplateLimits.items:
            raise _too_big(what, total)
    return total


def _check_printed(value, what: str = "a printed value", times: int = 1, extra: int = 0) -> None:
    if isinstance(value, str) and times == 1 and not extra:
        return
    size = _printed_size(value, what) * times + extra
    if size > TemplateLimits.items:
        raise _too_big(what, size)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sized(x) -> bool:
    return isinstance(x, (str, list, tuple, bytes))


def _check_width(width, what: str) -> None:
    if width > TemplateLimits.width:
        raise TemplateLimitError(f"chat template stopped: {what} {width:,} exceeds the limit of {TemplateLimits.width:,}")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_FIELD = re.compile(r"\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def _check_percent_format(fmt: str, args) -> None:
    """'%100000000s' % x would build 100 MB: refuse field widths past TemplateLimits.width;
    and size the result before it is built (each field at most the widest argument printed,
    '%(a)s' * 10**6 % {'a': s} included)."""
    star, widest, fields = False, 0, 0
    for width, precision in _PERCENT_SPEC.findall(fmt):
        fields += 1
        for value in (width, precision):
            if value == "*":
                star = True
            elif value:
                _check_width(int(value), "a field width")
                widest = max(widest, int(value))
    values = args if isinstance(args, tuple) else (args,)
    if star:
        for value in values:
            if _is_int(value):
                _check_width(abs(value), "a field width")
                widest = max(widest, abs(value))
    if fields:
        largest = max((_printed_size(v) for v in values), default=0)
        size = len(fmt) + fields * max(largest, widest)
        if size > TemplateLimits.items:
            raise _too_big("a formatted string", size)


def _check_brace_format(fmt: str, args, kwargs) -> None:
    """'{:>100000000}'.format(x) likewise; a width taken from the arguments ('{:{}}')
    must be small too; and the result is sized before it is built ('{0}' * 10**6)."""
    nested, widest, fields = False, 0, 0
    for field in _BRACE_FIELD.findall(fmt):
        fields += 1
        spec = field.partition(":")[2]
        if "{" in spec:
            nested = True
        for digits in re.findall(r"\d+", spec):
            _check_width(int(digits), "a field width")
            widest = max(widest, int(digits))
    if nested:
        for value in (*args, *kwargs.values()):
            if _is_int(value):
                _check_width(abs(value), "a field width")
                widest = max(widest, abs(value))
    if fields:
        largest = max((_printed_size(v) for v in (*args, *kwargs.values())), default=0)
        size = len(fmt) + fields * max(largest, widest)
        if size > TemplateLimits.items:
            raise _too_big("a formatted string", size)


def _check_binop(operator: str, left, right) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _sized(seq) and _is_int(n):
                _check_items(len(seq) * max(n, 0))
                if not isinstance(seq, (str, bytes)):
                    _charge(len(seq) * max(n, 0), "a list repeated")
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > TemplateLimits.int_bits:
            raise TemplateLimitError(f"chat template stopped: an integer of more than {TemplateLimits.int_bits:,} bits")
    elif operator == "+":
        if _sized(left) and _sized(right):
            _check_items(len(left) + len(right))
    elif operator == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            if right * math.log2(abs(left)) > TemplateLimits.int_bits:
                raise TemplateLimitError(
                    f"chat template stopped: an integer of more than {TemplateLimits.int_bits:,} bits")
    elif operator == "%" and isinstance(left, str):
        _check_percent_format(left, right)


_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def _line_count(s: str) -> int:
    """At least the number of lines str.splitlines finds (counted, not split)."""
    return sum(s.count(c) for c in _LINE_BREAKS) + 1


def _str_method_args(method, args, kwargs) -> tuple[tuple, dict, int | None]:
    """Bound a call of a str (or bytes) method before it runs: (args, kwargs, the most
    pieces a split may return). split and rsplit get a maxsplit no larger than the steps
    left (each piece is a step); splitlines and join are sized first."""
    s, name = method.__self__, method.__name__
    budget = _BUDGET.get()
    if budget is None:
        return args, kwargs, None
    if name in ("split", "rsplit"):
        try:
            bound = inspect.signature(method).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return args, kwargs, None
        given = bound.arguments.get("maxsplit", -1)
        left = max(TemplateLimits.steps - budget.steps, 0)
        if _is_int(given) and (given < 0 or given > left):
            bound.arguments["maxsplit"] = left
            return bound.args, bound.kwargs, left
    elif name == "splitlines":
        budget.charge(_line_count(s) if isinstance(s, str) else s.count(b"\n") + 1, f"{type(s).__name__}.splitlines")
    elif name == "join" and args:
        items = args[0]
        if not isinstance(items, (list, tuple, str, bytes)):
            items = list(_counted(items))
            args = (items, *args[1:])
        budget.charge(len(items), f"{type(s).__name__}.join")
        _check_printed(items, "a joined string", extra=len(s) * len(items))
    return args, kwargs, None


def _check_str_method(method, args, kwargs) -> None:
    """Methods of str whose result can be much larger than their inputs."""
    s, name = method.__self__, method.__name__
    if name in ("center", "ljust", "rjust", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        if _is_int(width):
            _check_items(width, "a padded string")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if _is_int(size):
            _check_items(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(size, 0), "a string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], type(s)) and isinstance(args[1], type(s)):
        old, new = args[0], args[1]
        count = s.count(old) if old else len(s) + 1
        limit = args[2] if len(args) > 2 else kwargs.get("count", -1)
        if _is_int(limit) and limit >= 0:
            count = min(count, limit)
        _check_items(len(s) + count * (len(new) - len(old)), "a string")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _check_items(len(s) * max(longest, 1), "a string")


# Filters whose result can be much larger than their inputs: checks on their arguments,
# by parameter name (some filters take the environment or context first).
def _filter_checks(name: str, arguments: dict) -> None:
    value = arguments.get("value", arguments.get("s"))
    if name == "join":
        separator = arguments.get("d", "")
        items = _size(value)
        if isinstance(separator, str) and items:
            _check_printed(value, "a joined string", extra=len(separator) * items)
    if name == "center" and _is_int(arguments.get("width")):
        _check_items(arguments["width"], "a padded string")
    elif name == "indent" and isinstance(value, str):
        width = arguments.get("width", 4)
        per_line = width if _is_int(width) else len(width) if isinstance(width, str) else 0
        _check_items(len(value) + per_line * (value.count("\n") + 1), "an indented string")
    elif name == "format" and isinstance(value, str):
        kwargs = arguments.get("kwargs") or {}
        _check_percent_format(value, tuple(arguments.get("args", ())) or (tuple(kwargs.values()) if kwargs else ()))
    elif name in ("batch", "slice"):
        count = arguments.get("linecount", arguments.get("slices"))
        if _is_int(count):
            _check_width(count, f"the {name} size")
    elif name == "tojson" and _is_int(arguments.get("indent")):
        _check_width(arguments["indent"], "the JSON indent")
    elif name == "replace" and isinstance(value, str):
        old, new = arguments.get("old"), arguments.get("new")
        if isinstance(old, str) and isinstance(new, str):
            count = value.count(old) if old else len(value) + 1
            if _is_int(arguments.get("count")) and arguments["count"] >= 0:
                count = min(count, arguments["count"])
            _check_items(len(value) + count * (len(new) - len(old)), "a string")
    elif name == "wordwrap" and isinstance(value, str):
        wrap = arguments.get("wrapstring") or "\n"
        _check_items(len(value) * (1 + len(wrap)), "a wrapped string")


# What each filter costs before it runs (see _guard_filter). Filters that are O(1) on
# anything; filters that work on a string at C speed (no charge for a string value; any
# other value is charged its items); filters that sort; filters that turn their value into
# text (a value that is not a string is sized, _printed_size, before it is).
_FREE_FILTERS = frozenset({"abs", "attr", "count", "d", "default", "first", "last", "length", "random", "round",
                           "float", "int", "filesizeformat"})
_STRING_FILTERS = frozenset({"capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower",
                             "replace", "reverse", "safe", "string", "trim", "truncate", "upper", "wordcount",
                             "tojson"})
_SORTING_FILTERS = frozenset({"sort", "dictsort", "groupby"})
_PRINTING_FILTERS = frozenset({"capitalize", "center", "e", "escape", "forceescape", "indent", "lower", "replace",
                               "safe", "string", "striptags", "title", "trim", "truncate", "upper", "urlize",
                               "wordcount", "wordwrap", "pprint", "tojson", "join", "xmlattr", "urlencode"})
_CONTEXT_ARGUMENTS = ("eval_ctx", "context", "environment", "env")


def _counted(iterable) -> Iterator:
    """Iterate `iterable`, one step per item."""
    budget = _BUDGET.get()
    for item in iterable:
        if budget is not None:
            budget.step()
        yield item


def _size(value) -> int | None:
    try:
        return len(value)
    except TypeError:
        return None


def _guard_filter(name: str, fn):
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    # A filter marked pass_context / pass_eval_context / pass_environment receives that
    # first; jinja's async variants take it without naming it in the signature shown.
    skip = 0
    if signature is not None and getattr(fn, "jinja_pass_arg", None) is not None:
        first = next(iter(signature.parameters), None)
        skip = 0 if first in _CONTEXT_ARGUMENTS else 1

    @functools.wraps(fn)  # keeps jinja's pass_context / pass_environment marker
    def guarded(*args, **kwargs):
        budget = _BUDGET.get()
        if budget is None:
            # Only inside a render: jinja's optimizer would otherwise run a filter over a
            # constant at compile time, unbounded; an error here makes it leave the call to
            # the render.
            raise TemplateLimitError("filters run only inside a render")
        budget.step()
        if signature is not None:
            try:
                bound = signature.bind(*args[skip:], **kwargs)
            except TypeError:
                pass  # the filter itself reports the bad call
            else:
                if _prepare_filter(name, bound):
                    args, kwargs = (*args[:skip], *bound.args), bound.kwargs
                _filter_checks(name, bound.arguments)
        return _checked(fn(*args, **kwargs))

    return guarded


def _prepare_filter(name: str, bound: inspect.BoundArguments) -> bool:
    """Charge a filter call the items it goes through, before it runs; returns whether
    its value was replaced (an iterator by a counting one, or by the list of its items
    for a sort)."""
    key = next((k for k in bound.arguments if k not in _CONTEXT_ARGUMENTS), None)
    if key is None or name in _FREE_FILTERS:
        return False
    value = bound.arguments[key]
    if isinstance(value, jinja2.Undefined):
        return False
    if isinstance(value, str) and name in _STRING_FILTERS:
        if name == "indent":
            _charge(_line_count(value), "indent")
        return False
    n = _size(value)
    replaced = False
    if n is None and isinstance(value, Iterator):
        if name in _SORTING_FILTERS or name in ("sum", "join", "tojson", "pprint", "string"):
            value = list(_counted(value))  # sized below like any list
            n = len(value)
        else:
            value = _counted(value)  # each item a step as the filter takes it
        bound.arguments[key] = value
        replaced = True
    if n is not None:
        _charge(n, f"the {name} filter over {n:,} items")
        if name in _SORTING_FILTERS:
            _charge(_sort_work(n), f"sorting {n:,} items")
        if name == "sum" and not _is_number(bound.arguments.get("start", 0)):
            # sum() of lists or strings copies the growing result once per item
            _charge(n * _printed_size(value), f"summing {n:,} sequences")
    if name in _PRINTING_FILTERS and not isinstance(value, str):
        _check_printed(value, f"the {name} filter's text")
    return replaced


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _wordcount(s) -> int:
    """jinja's wordcount (the number of \\w+ runs), counted by re.subn instead of a list of
    every word."""
    return re.subn(r"\w+", "", jinja2.filters.soft_str(s))[1]


def _loop(iterable):
    """Every for loop of a template iterates through this (see _instrument)."""
    budget = _BUDGET.get()
    if budget is None or isinstance(iterable, jinja2.Undefined):
        return iterable

    def counted():
        for item in iterable:
            budget.step()
            yield item

    return counted()


def _finalize(value):
    """Every {{ value }} passes here before str(): a value that is not a string is sized first."""
    if not isinstance(value, str):
        _check_printed(value)
    return value


def _strftime_now(fmt):
    """strftime_now with its result sized first ('%c' is 24 characters from 2)."""
    if isinstance(fmt, str):
        _check_items(len(fmt) + 64 * fmt.count("%"), "a formatted date")
    return datetime.now().strftime(fmt)


_BLOCK_TAGS = frozenset({"for", "if", "macro", "call", "filter", "with", "block", "autoescape"})
_OPERATORS = frozenset({"+", "-", "*", "/", "//", "%", "**", "~", "|", "==", "!=", "<", ">", "<=", ">=", "."})
_WORD_OPERATORS = frozenset({"and", "or", "not", "in", "is", "if", "else"})


def _check_shape(env: jinja2.Environment, text: str, source: Path) -> None:
    """Refuse a template too large, or nested too deeply for jinja2's recursive parser and
    Python's compiler (100 levels of indentation, 20 nested loops, 200 nested brackets),
    before either runs: jinja2's lexer is a loop over regular expressions, so this costs
    one pass and no recursion. What the counts miss, the caller catches."""
    if len(text) > TemplateLimits.source:
        raise TokenizerError(f"{source}: chat template is {len(text):,} characters; the limit is "
                             f"{TemplateLimits.source:,}")
    limit = TemplateLimits.nesting
    blocks: list[str] = []
    brackets = operators = 0
    expect_tag, in_set = False, False
    try:
        tokens = env.lex(text)
        for line, kind, value in tokens:
            if kind in ("block_begin", "variable_begin"):
                expect_tag, operators, brackets = kind == "block_begin", 0, 0
                continue
            if kind in ("block_end", "variable_end"):
                if in_set:  # '{% set x %}' without '=': a block, until endset
                    blocks.append("set")
                    in_set = False
                continue
            if kind == "whitespace":
                continue
            if expect_tag:
                expect_tag = False
                if kind == "name":
                    if value in _BLOCK_TAGS:
                        blocks.append(value)
                    elif value == "set":
                        in_set = True
                    elif value.startswith("end") and blocks:
                        blocks.pop()
                    if len(blocks) > limit:
                        raise TokenizerError(f"{source}: chat template is nested too deeply: blocks inside blocks "
                                             f"more than {limit} deep at line {line}")
                continue
            if kind == "operator":
                if value in "([{":
                    brackets += 1
                    if brackets > limit:
                        raise TokenizerError(f"{source}: chat template is nested too deeply: brackets inside "
                                             f"brackets more than {limit} deep at line {line}")
                elif value in ")]}":
                    brackets -= 1
                elif value == "=":
                    in_set = False
                elif value in _OPERATORS:
                    operators += 1
            elif kind == "name" and value in _WORD_OPERATORS:
                operators += 1
            if operators > TemplateLimits.operators:
                raise TokenizerError(f"{source}: chat template is nested too deeply: more than "
                                     f"{TemplateLimits.operators} operators and filters in one expression at line "
                                     f"{line}")
    except jinja2.TemplateSyntaxError:
        return  # the parser reports it, with its own message


def _concat(*parts) -> str:
    """The ~ operator, with a size check (of what each part prints as, before str())."""
    _check_printed(list(parts), "a joined string")
    pieces = [str(p) for p in parts]
    _check_items(sum(map(len, pieces)))
    return "".join(pieces)


def _lipsum(n=5, html=True, min=20, max=100):
    from jinja2.utils import generate_lorem_ipsum

    if not all(_is_int(v) for v in (n, min, max)) or n * max > TemplateLimits.lipsum_words:
        raise TemplateLimitError(f"chat template stopped: lipsum is limited to {TemplateLimits.lipsum_words:,} words")
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class _LimitedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox transformers uses, plus the limits of TemplateLimits."""

    # Intercepted operators are also never folded at compile time (so '{{ "x" * 10**10 }}'
    # cannot allocate while compiling).
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        _step()
        _check_binop(operator, left, right)
        return _checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        _step()
        pieces = None
        if isinstance(getattr(__obj, "__self__", None), (str, bytes)) and not isinstance(__obj, type):
            _check_str_method(__obj, args, kwargs)
            args, kwargs, pieces = _str_method_args(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if pieces is not None:
            if len(result) > pieces:
                raise TemplateLimitError(f"chat template stopped: {__obj.__name__} into more than {pieces:,} pieces "
                                         f"would take the render past {TemplateLimits.steps:,} steps")
            _charge(len(result), f"{__obj.__name__}")
        return _checked(result)

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        def checked_format(*args, **kwargs):
            if value.__name__ == "format_map" and args and isinstance(args[0], dict):
                _check_brace_format(fmt, (), args[0])
            else:
                _check_brace_format(fmt, args, kwargs)
            return _checked(wrapper(*args, **kwargs))

        return checked_format


def _instrument(ast: jnodes.Template, source: Path) -> jnodes.Template:
    """Route every for loop's iterable through _loop and every ~ through _concat (jinja
    compiles both to plain Python that no sandbox hook sees)."""
    for name in ast.find_all(jnodes.Name):
        if name.name in (_LOOP_NAME, _CONCAT_NAME):
            raise TokenizerError(f"{source}: chat template uses the reserved name {name.name!r}")
    for loop in list(ast.find_all(jnodes.For)):
        loop.iter = jnodes.Call(jnodes.Name(_LOOP_NAME, "load"), [loop.iter], [], None, None,
                                lineno=loop.iter.lineno)
    for concat in list(ast.find_all(jnodes.Concat)):
        call = jnodes.Call(jnodes.Name(_CONCAT_NAME, "load"), list(concat.nodes), [], None, None,
                           lineno=concat.lineno)
        concat.nodes = [call]  # a Concat of one part is that part, as a string
    return ast


class _MissingSpecialToken(jinja2.Undefined):
    """A special token tokenizer_config.json does not define: false in tests, an error
    when printed or combined."""

    __slots__ = ()

    def __str__(self) -> str:
        return self._fail_with_undefined_error()


class ChatTemplate:
    """One compiled chat template; `source` is the file it came from (for messages) and
    `special_tokens` the tokens tokenizer_config.json defines."""

    def __init__(self, text: str, source: Path, special_tokens: dict[str, str], config_path: Path):
        self.text, self.source, self.special_tokens = text, source, special_tokens
        self.missing = {
            name: _MissingSpecialToken(
                hint=f"the chat template uses {name}, but {config_path} defines no {name}", name=name,
                exc=TokenizerError)
            for name in SPECIAL_TOKEN_NAMES if name not in special_tokens
        }
        env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=_finalize)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env.filters["tojson"] = tojson
        env.filters["wordcount"] = _wordcount
        env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["lipsum"] = _lipsum
        env.globals[_LOOP_NAME] = _loop
        env.globals[_CONCAT_NAME] = _concat
        try:
            _check_shape(env, text, source)
            self.template = env.from_string(_instrument(env.parse(text), source))
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{source}: chat template syntax error at line {e.lineno}: {e.message}") from None
        except (RecursionError, MemoryError):
            raise TokenizerError(f"{source}: chat template is nested too deeply (for jinja2's parser)") from None
        except SyntaxError as e:  # from compile(): IndentationError, "too many statically nested blocks", ...
            raise TokenizerError(f"{source}: chat template is nested too deeply for Python to compile it "
                                 f"({e.msg})") from None
        except ValueError as e:
            raise TokenizerError(f"{source}: chat template cannot be compiled ({e})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        token = _BUDGET.set(_Budget())
        try:
            pieces, size = [], 0
            for piece in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **self.missing, **self.special_tokens):
                size += len(piece)
                if size > TemplateLimits.items:
                    raise TemplateLimitError(f"chat template stopped: its output exceeds {TemplateLimits.items:,} "
                                             "characters")
                pieces.append(piece)
            return "".join(pieces)
        except TemplateLimitError as e:
            raise TemplateLimitError(f"{e} (in {self.source})") from None
        except TwiceError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TokenizerError(f"chat template refused by the sandbox: {e} (in {self.source})") from None
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template failed to render: {e} (in {self.source})") from None
        except MemoryError:
            raise TokenizerError(f"chat template failed to render: it ran out of memory (in {self.source})") from None
        except Exception as e:  # a template can raise anything its expressions raise
            raise TokenizerError(f"chat template failed to render: {type(e).__name__}: {e} (in {self.source})") from None
        finally:
            _BUDGET.reset(token)
