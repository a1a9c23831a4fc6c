"""A chat template rendered within a budget of work. Jinja's sandbox stops what a template may touch, not how long it
runs: it caps each `range` at 100,000 items, so two nested loops over such ranges run for hours. Here every loop
iteration, call and filter, and the size of what a template builds (a range, a repetition with `*`, a power), count
against one budget per rendering (STEPS); a template that passes it stops with TemplateBudgetExceeded naming its line.

The environment is transformers' own (its filters, globals, extensions and options, taken from the one
apply_chat_template compiles with) with the counting added, and `render` passes what apply_chat_template passes, so
the text is the same as transformers renders; a transformers release that moves that compiler renders unbounded.
"""

from __future__ import annotations

import functools
import inspect
import threading
import traceback
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import TemplateError
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

# Steps one rendering may take: a loop iteration or a call is one, a list built or read by a filter one per item, a
# string one per 64 characters (C-speed work). Qwen3.5's template renders 1,500 messages with tool calls and
# reasoning in about 60,000; a runaway template reaches it within seconds (about 0.4 us a step).
STEPS = 5_000_000
MACRO_CALL = 25  # a call of a template's macro costs about as much as 25 loop iterations
_COUNT_FILTER = "_hybridtune_counted"
# Filters whose cost does not grow with their input: one step whatever its size.
_FLAT_FILTERS = frozenset({"length", "count", "first", "last", "default", "d", "attr", _COUNT_FILTER})
_OPTIONS = (
    "block_start_string",
    "block_end_string",
    "variable_start_string",
    "variable_end_string",
    "comment_start_string",
    "comment_end_string",
    "line_statement_prefix",
    "line_comment_prefix",
    "trim_blocks",
    "lstrip_blocks",
    "newline_sequence",
    "keep_trailing_newline",
    "optimized",
    "undefined",
    "finalize",
    "autoescape",
)


class TemplateBudgetExceeded(TemplateError):
    """A rendering passed STEPS; `line` is the template's line it was at (0: unknown)."""

    def __init__(self, steps: int, line: int = 0) -> None:
        self.steps, self.line = steps, line
        at = f" (at line {line} of the template)" if line else ""
        super().__init__(
            f"the chat template did more than {steps:,} steps of work rendering one conversation{at}: a loop "
            "that does not end or nested loops over large ranges; fix the template, or set chat_template to another"
        )


_state = threading.local()  # .left: the steps the rendering in progress may still take


def _charge(steps: int) -> None:
    left = getattr(_state, "left", None)
    if left is None:  # compiled here but rendered outside `render`: nothing to count against
        return
    left -= steps
    _state.left = left
    if left < 0:
        raise TemplateBudgetExceeded(STEPS)


def _size(value: Any) -> int:
    """The steps reading `value` costs (0 for what is not a container or text)."""
    if isinstance(value, str):
        return len(value) // 64
    if isinstance(value, (list, tuple, dict, range)):
        return len(value)
    return 0


def _counted(iterable: Any):
    """A loop's iterable, one step per item."""
    for item in iterable:
        _charge(1)
        yield item


def _counted_filter(name: str, f):
    if name in _FLAT_FILTERS:

        @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
        def flat(*args, **kwargs):
            _charge(1)
            return f(*args, **kwargs)

        return flat

    @functools.wraps(f)
    def sized(*args, **kwargs):
        _charge(1 + sum(map(_size, args)))
        return f(*args, **kwargs)

    return sized


def _counted_range(*args: int) -> range:
    r = safe_range(*args)
    _charge(len(r))
    return r


class _CountingCodeGenerator(CodeGenerator):
    """Compiles every `{% for %}` over its iterable passed through the counting filter."""

    def visit_Template(self, node: nodes.Template, frame=None) -> None:
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _COUNT_FILTER, [], [], None, None, lineno=loop.lineno)
        super().visit_Template(node, frame)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _CountingCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+"})

    def call(self, context, obj, /, *args, **kwargs):  # positional-only: a keyword named `obj` reaches `obj`'s call
        _charge((MACRO_CALL if isinstance(obj, Macro) else 1) + sum(map(_size, args)))
        return super().call(context, obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            _charge(right * max(0, abs(left).bit_length() - 1) // 64)  # the result's size, before it is computed
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and n > 0 and isinstance(seq, (str, list, tuple)):  # the result's size
                _charge(len(seq) * n // 64 if isinstance(seq, str) else len(seq) * n)
        elif operator == "+" and isinstance(left, (str, list, tuple)):
            _charge(_size(left) + _size(right))
        return super().call_binop(context, operator, left, right)


def _lipsum(base):
    """jinja's lipsum, charged for the words it may write (n paragraphs of at most `max` words) before it runs."""
    signature = inspect.signature(base)

    @functools.wraps(base)
    def lipsum(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _charge(max(1, int(bound.arguments["n"])) * max(1, int(bound.arguments["max"])) // 8)
        return base(*args, **kwargs)

    return lipsum


@functools.lru_cache(maxsize=1)
def _environment() -> _BoundedEnvironment | None:
    """transformers' chat-template environment with the counting; None where transformers moves its compiler."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        base = _compile_jinja_template("").environment
    except (ImportError, AttributeError):
        return None
    env = _BoundedEnvironment(
        **{k: getattr(base, k) for k in _OPTIONS}, extensions=[type(e) for e in base.extensions.values()]
    )
    env.filters.update({name: _counted_filter(name, f) for name, f in base.filters.items()})
    env.filters[_COUNT_FILTER] = _counted
    env.tests.update(base.tests)
    env.policies.update(base.policies)
    env.globals.update(base.globals)
    env.globals["range"] = _counted_range
    if "lipsum" in env.globals:
        env.globals["lipsum"] = _lipsum(env.globals["lipsum"])
    return env


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    return _environment().from_string(template)


def _template_line(e: BaseException) -> int:
    """The template's line in a traceback jinja rewrote (its frames are named '<template>'), else 0."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>"]
    return lines[-1] if lines and lines[-1] else 0


def render(
    tokenizer, messages: list[dict], tools: list | None, generation_prompt: bool, template_kwargs: dict | None
) -> str:
    """What `tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...,
    **template_kwargs)` returns, rendered within STEPS (TemplateBudgetExceeded past it)."""
    kwargs = template_kwargs or {}
    if _environment() is None:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    compiled = _compiled(tokenizer.get_chat_template(None, tools))
    variables = {**tokenizer.special_tokens_map, **kwargs}  # as apply_chat_template: kwargs over special tokens
    outer = getattr(_state, "left", None)
    _state.left = STEPS
    try:
        return compiled.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=generation_prompt, **variables
        )
    except TemplateBudgetExceeded as e:
        raise TemplateBudgetExceeded(STEPS, _template_line(e)) from None
    finally:
        _state.left = outer
