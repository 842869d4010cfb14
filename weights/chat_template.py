"""Chat templates: untrusted jinja2 programs from the model's author, rendered the way
transformers renders them (same options, same helpers) but only inside jinja2's
ImmutableSandboxedEnvironment, which refuses access to Python internals, and under limits
on what one render may cost (see `TemplateLimits`): a template that loops or recurses
without end, or builds gigabytes of text, is stopped with a one-line TokenizerError
instead of hanging or exhausting memory.

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

    steps = 1_000_000  # loop iterations plus calls (macros, methods, filters), all loops together
    seconds = 5.0  # wall time of one render
    items = 16 * 2**20  # characters of any one string built (items of a list), and of the output
    width = 10_000  # a field width in a format string ('%20s', '{:>20}')
    int_bits = 65_536  # integers a template computes (2**65536 is already 19,729 digits)
    lipsum_words = 10_000


class TemplateLimitError(TokenizerError):
    """A chat template went past one of TemplateLimits."""


_BUDGET: contextvars.ContextVar = contextvars.ContextVar("twice_template_budget", default=None)
_LOOP_NAME = "_twice_loop"  # the names the compiled template calls; templates may not use them
_CONCAT_NAME = "_twice_concat"


class _Budget:
    def __init__(self):
        self.deadline = time.monotonic() + TemplateLimits.seconds
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > TemplateLimits.steps:
            raise TemplateLimitError(f"chat template stopped: more than {TemplateLimits.steps:,} loop iterations "
                                     "and calls in one render (does it loop without end?)")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"chat template stopped: rendering took longer than {TemplateLimits.seconds:g} s")


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.step()


def _too_big(what: str, size) -> TemplateLimitError:
    return TemplateLimitError(f"chat template stopped: {what} of {size:,} would exceed the limit of "
                              f"{TemplateLimits.items:,}")


def _check_items(size: int, what: str = "a string or list") -> None:
    if size > TemplateLimits.items:
        raise _too_big(what, size)


def _checked(result):
    if isinstance(result, (str, list, tuple, dict, bytes)):
        _check_items(len(result))
    return result


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
    """'%100000000s' % x would build 100 MB: refuse field widths past TemplateLimits.width."""
    star = False
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for value in (width, precision):
            if value == "*":
                star = True
            elif value:
                _check_width(int(value), "a field width")
    if star:
        values = args if isinstance(args, tuple) else (args,)
        for value in values:
            if _is_int(value):
                _check_width(abs(value), "a field width")


def _check_brace_format(fmt: str, args, kwargs) -> None:
    """'{:>100000000}'.format(x) likewise; a width taken from the arguments ('{:{}}')
    must be small too."""
    nested = False
    for field in _BRACE_FIELD.findall(fmt):
        spec = field.partition(":")[2]
        if "{" in spec:
            nested = True
        for digits in re.findall(r"\d+", spec):
            _check_width(int(digits), "a field width")
    if nested:
        for value in (*args, *kwargs.values()):
            if _is_int(value):
                _check_width(abs(value), "a field width")


def _check_binop(operator: str, left, right) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _sized(seq) and _is_int(n):
                _check_items(len(seq) * max(n, 0))
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
            _check_items(len(s) + s.count("\t") * max(size, 0), "a string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
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
    if name == "center" and _is_int(arguments.get("width")):
        _check_items(arguments["width"], "a padded string")
    elif name == "indent" and isinstance(value, str):
        width = arguments.get("width", 4)
        per_line = width if _is_int(width) else len(width) if isinstance(width, str) else 0
        _check_items(len(value) + per_line * (value.count("\n") + 1), "an indented string")
    elif name == "format" and isinstance(value, str):
        _check_percent_format(value, tuple(arguments.get("args", ())) or arguments.get("kwargs") or ())
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
        skip = 0 if first in ("eval_ctx", "context", "environment", "env") else 1

    @functools.wraps(fn)  # keeps jinja's pass_context / pass_environment marker
    def guarded(*args, **kwargs):
        _step()
        if signature is not None:
            try:
                bound = signature.bind(*args[skip:], **kwargs)
            except TypeError:
                pass  # the filter itself reports the bad call
            else:
                _filter_checks(name, bound.arguments)
        return _checked(fn(*args, **kwargs))

    return guarded


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


def _concat(*parts) -> str:
    """The ~ operator, with a size check."""
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
        if isinstance(getattr(__obj, "__self__", None), str) and not isinstance(__obj, type):
            _check_str_method(__obj, args, kwargs)
        return _checked(super().call(__context, __obj, *args, **kwargs))

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
        env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env.filters["tojson"] = tojson
        env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.globals["lipsum"] = _lipsum
        env.globals[_LOOP_NAME] = _loop
        env.globals[_CONCAT_NAME] = _concat
        try:
            self.template = env.from_string(_instrument(env.parse(text), source))
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{source}: chat template syntax error at line {e.lineno}: {e.message}") from None
        except RecursionError:
            raise TokenizerError(f"{source}: chat template is nested too deeply") from None

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
