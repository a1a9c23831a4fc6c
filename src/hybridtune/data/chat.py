"""Chat templates: choosing one (`chat_template`), and splitting a rendered conversation into trained and
untrained text for any template, also one that does not render a conversation prefix-stably (Qwen3.5's).

The whole conversation is rendered once (F) and each trained message is located in F:

    <|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n<think>\\nR\\n</think>\\n\\nA<|im_end|>\\n
                                   '------ header -------------''------ trained -------------'

content: where F rendered again with a sentinel for the message's content differs from F; start: the end of the
nearest generation-prompt header before it (learnt from a probe render; another trained role trains from its
header's opening special token); end: through the end-of-turn marker after the content (learnt from a probe), not
the newline after it. Character spans become token masks through the fast tokenizer's offsets
(formats._tokenize_spans).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridtune.data.template_budget import TemplateBudgetExceeded
from hybridtune.data.template_budget import render as bounded_render
from hybridtune.data.template_fields import check_rendered
from hybridtune.errors import ConfigError
from hybridtune.textfile import not_a_file

# Private-use characters: no text or template contains them, so a sentinel made of them differs from the content it
# replaces at both ends, and the common prefix and suffix stop exactly at the content.
_SENTINELS = ("\ue000\ue001", "\ue002\ue003", "\ue004\ue005", "\ue006\ue007")
_PROBE_USER = "\ue010"
TEMPLATE_SUFFIXES = (".jinja", ".jinja2", ".j2", ".txt")


class TurnNotFound(ValueError):
    """A trained message cannot be located in the rendered conversation (the message names it)."""


def template_names(tokenizer) -> list[str]:
    """The names of the tokenizer's named templates (its chat_template is a dict), else []."""
    return sorted(tokenizer.chat_template) if isinstance(tokenizer.chat_template, dict) else []


def with_chat_template(tokenizer, choice: str | None):
    """The tokenizer to tokenise data with: `tokenizer` itself when `choice` is empty, else a copy whose template is
    `choice`: the name of one of the tokenizer's named templates, or a .jinja/.txt file. The copy is saved with the
    final model, so the template trained with is the one served."""
    if not choice:
        return tokenizer
    names = template_names(tokenizer)
    if choice in names:
        template, origin = tokenizer.chat_template[choice], f"the tokenizer's template '{choice}'"
    else:
        path = Path(choice).expanduser()
        if not path.is_file():
            if path.suffix.lower() in TEMPLATE_SUFFIXES or "/" in choice or path.exists():
                what = not_a_file(path)
                raise ConfigError(
                    f"chat_template: file '{choice}' {what}; give a .jinja or .txt file holding a Jinja chat template"
                )
            known = f"its named templates: {', '.join(names)}" if names else "it has no named templates"
            raise ConfigError(
                f"chat_template: '{choice}' is neither a file nor a named template of the tokenizer ({known}); "
                "give a .jinja file or one of those names"
            )
        try:
            template = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"chat_template: file '{choice}' is not UTF-8 text (byte {e.start}); save it as UTF-8"
            ) from None
        except OSError as e:
            raise ConfigError(f"chat_template: cannot read '{choice}' ({e.strerror})") from None
        origin = f"file '{choice}'"
        if not template.strip():
            raise ConfigError(f"chat_template: file '{choice}' is empty; give a Jinja chat template")
    _check_syntax(template, origin)
    chosen = copy.deepcopy(tokenizer)
    chosen.chat_template = template
    return chosen


def _check_syntax(template: str, origin: str) -> None:
    """A syntax error found now, as one line, rather than at the first row. transformers' own compiler (its Jinja
    environment has the `generation` tag); skipped where a transformers release moves it."""
    from jinja2 import TemplateSyntaxError

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise ConfigError(
            f"chat_template: {origin} is not a valid Jinja template (line {e.lineno}: {e.message})"
        ) from None


# apply_chat_template's own arguments: a `chat_template_kwargs` key of these names would replace what hybridtune
# passes (or be refused by transformers at the first row), so they are refused at once.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def check_template_kwargs(kwargs: dict | None, where: str = "chat_template_kwargs") -> dict:
    """`kwargs` as the chat template gets them: a mapping of names to JSON values (`{enable_thinking: false}`),
    none of apply_chat_template's own arguments. ConfigError in one line otherwise."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ConfigError(
            f"{where}: give a mapping of template variable names to values, e.g. {{enable_thinking: false}}"
        )
    taken = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if taken:
        raise ConfigError(
            f"{where}: {', '.join(taken)} {'is' if len(taken) == 1 else 'are'} set by hybridtune itself; "
            "give only the template's own variables (e.g. enable_thinking)"
        )
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"{where}: values must be JSON values (text, numbers, booleans, lists, mappings): {e}"
        ) from None
    return dict(kwargs)


def render(
    tokenizer,
    messages: list[dict],
    tools: list | None = None,
    generation_prompt: bool = False,
    template_kwargs: dict | None = None,
) -> str:
    """The conversation through the tokenizer's chat template, as apply_chat_template renders it, within a budget of
    work (data/template_budget.py: TemplateBudgetExceeded past it)."""
    return bounded_render(tokenizer, messages, tools, generation_prompt, template_kwargs)


def render_conversation(
    tokenizer, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None
) -> tuple[list[dict], str]:
    """(messages, F). A template that iterates tool-call arguments as a mapping (Qwen3.5's) cannot render them as
    the JSON strings OpenAI-style data holds; then they are parsed into objects and the rendering retried."""
    try:
        return messages, render(tokenizer, messages, tools, template_kwargs=template_kwargs)
    except TemplateBudgetExceeded:
        raise
    except Exception:
        parsed = _parse_string_arguments(messages)
        if parsed is None:
            raise
        return parsed, render(tokenizer, parsed, tools, template_kwargs=template_kwargs)


def _parse_string_arguments(messages: list[dict]) -> list[dict] | None:
    """A copy of `messages` with tool-call arguments given as JSON-object strings parsed; None when there are none."""
    changed = False
    out = []
    for m in messages:
        calls = []
        for call in m.get("tool_calls") or ():
            nested = isinstance(call.get("function"), dict)  # OpenAI: {"type": "function", "function": {...}}
            fn = call["function"] if nested else call
            args = _json_object(fn.get("arguments"))
            if args is not None:
                fn = {**fn, "arguments": args}
                call = {**call, "function": fn} if nested else fn
                changed = True
            calls.append(call)
        out.append({**m, "tool_calls": calls} if calls else m)
    return out if changed else None


def _json_object(value: Any) -> dict | None:
    if not isinstance(value, str):
        return None
    try:
        obj = json.loads(value)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


@dataclass(frozen=True)
class TurnMarks:
    """What a template writes around an assistant turn, learnt from probe renders."""

    header_cuts: tuple[str, ...]  # prefixes of the generation prompt ending at a boundary, longest first
    opener: str  # the generation prompt's first special token ('<|im_start|>'), '' when it starts with none
    footer: str  # the end-of-turn marker after a message's content ('<|im_end|>'), '' when there is none


_MARKS: dict[tuple, TurnMarks] = {}


def turn_marks(
    tokenizer, tools: list | None, fallback_context: list[dict] | None = None, template_kwargs: dict | None = None
) -> TurnMarks:
    """The template's turn marks, from a probe conversation of one user message (cached per template and keyword
    arguments: `enable_thinking: false` changes the generation prompt); when the template refuses that probe, from
    `fallback_context` (the messages before the first trained turn)."""
    template = tokenizer.get_chat_template(None, tools)
    kw = template_kwargs or {}
    key = (template, tools is not None, repr(tokenizer.special_tokens_map), json.dumps(kw, sort_keys=True))
    if key in _MARKS:
        return _MARKS[key]
    try:
        marks = _probe(tokenizer, tools, [{"role": "user", "content": _PROBE_USER}], kw)
    except TemplateBudgetExceeded:
        raise
    except Exception:
        if not fallback_context:
            raise
        return _probe(tokenizer, tools, fallback_context, kw)
    if len(_MARKS) > 64:
        _MARKS.clear()
    _MARKS[key] = marks
    return marks


def _probe(tokenizer, tools: list | None, context: list[dict], kw: dict) -> TurnMarks:
    specials = _special_strings(tokenizer)
    before = render(tokenizer, context, tools, template_kwargs=kw)
    prompted = render(tokenizer, context, tools, generation_prompt=True, template_kwargs=kw)
    header = prompted[len(before) :] if prompted.startswith(before) else ""
    sentinel = _sentinel(before)
    closed = render(tokenizer, [*context, {"role": "assistant", "content": sentinel}], tools, template_kwargs=kw)
    footer = closed[closed.rfind(sentinel) + len(sentinel) :] if sentinel in closed else ""
    footer = footer.rstrip()
    first = next((s for s in specials if footer.startswith(s)), None)
    if first is None:  # a marker that is not one special token: up to the first special token inside it
        cut = min((footer.find(s) + len(s) for s in specials if s in footer), default=len(footer))
        footer = footer[:cut]
    else:
        footer = first
    bounds = {i + 1 for i, ch in enumerate(header) if ch == "\n"} | {len(header)}
    opener = ""
    for s in specials:
        at = header.find(s)
        while at >= 0:
            bounds.add(at + len(s))
            if at == 0:
                opener = s
            at = header.find(s, at + 1)
    # A prefix that holds only special tokens ('<|im_start|>') names no role: it cannot tell the turn apart.
    cuts = [header[:b] for b in sorted(bounds, reverse=True) if b and _strip_specials(header[:b], specials).strip()]
    return TurnMarks(tuple(cuts), opener, footer)


def _special_strings(tokenizer) -> list[str]:
    """Special and added tokens (e.g. '<think>'), longest first."""
    found = set(tokenizer.all_special_tokens)
    try:
        found |= set(tokenizer.get_added_vocab())
    except Exception:  # a tokenizer without added-token bookkeeping
        pass
    return sorted((s for s in found if s), key=len, reverse=True)


def _strip_specials(text: str, specials: Sequence[str]) -> str:
    for s in specials:
        text = text.replace(s, "")
    return text


def _sentinel(*texts: str) -> str:
    found = next((s for s in _SENTINELS if not any(s[0] in t or s[1] in t for t in texts)), None)
    if found is None:
        raise TurnNotFound("its text holds every private-use sentinel character hybridtune could mark it with")
    return found


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search over slice comparisons: C-speed compares instead of a Python loop per char
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _content_span(tokenizer, messages: list[dict], j: int, full: str, tools: list | None, kw: dict) -> tuple[int, int]:
    sentinel = _sentinel(full, *(str(m.get("content") or "") for m in messages))
    marked = [*messages[:j], {**messages[j], "content": sentinel}, *messages[j + 1 :]]
    other = render(tokenizer, marked, tools, template_kwargs=kw)
    p = _common_prefix(full, other)
    s = _common_suffix(full, other, min(len(full), len(other)) - p)
    if sentinel not in other[p : len(other) - s]:
        raise TurnNotFound("the template does not render its content")
    return p, len(full) - s


def chat_spans(
    tokenizer,
    messages: list[dict],
    trained: Sequence[bool],
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) spans; `trained[j]` says whether message j is trained;
    `template_kwargs` go to every rendering. Raises TurnNotFound naming the message that cannot be located, and
    FieldNotRendered (data/template_fields.py) for a tool call, reasoning or tools the template ignores."""
    kw = template_kwargs or {}
    messages, full = render_conversation(tokenizer, messages, tools, kw)
    check_rendered(tokenizer, messages, tools, kw, lambda ms, ts: render(tokenizer, ms, ts, template_kwargs=kw))
    regions: list[tuple[int, int]] = []
    marks = None
    for j, m in enumerate(messages):
        if not trained[j]:
            continue
        if marks is None:
            marks = turn_marks(tokenizer, tools, messages[:j], kw)
        try:
            regions.append(_locate(tokenizer, messages, j, full, tools, marks, kw))
        except TurnNotFound as e:
            raise TurnNotFound(
                f"cannot locate message {j} (role {m['role']!r}) in the rendered conversation: {e}"
            ) from None
    spans: list[tuple[str, bool]] = []
    pos = 0
    for start, end in regions:
        if start < pos:  # two trained turns in one rendered turn (grouped tool results): one region
            start = pos
        if start > pos:
            spans.append((full[pos:start], False))
        if end > start:
            spans.append((full[start:end], True))
        pos = max(pos, end)
    if pos < len(full):
        spans.append((full[pos:], False))
    return spans


def _locate(tokenizer, messages: list[dict], j: int, full: str, tools: list | None, marks: TurnMarks, kw: dict):
    a, b = _content_span(tokenizer, messages, j, full, tools, kw)
    if messages[j]["role"] == "assistant":
        best = (-1, 0)
        for cut in marks.header_cuts:  # longest first: at equal positions the longer prefix wins
            at = full.rfind(cut, 0, a)
            if at > best[0]:
                best = (at, len(cut))
        if best[0] >= 0:
            start = sum(best)
        elif marks.header_cuts:
            raise TurnNotFound(f"no assistant header {marks.header_cuts[-1]!r} before its content")
        else:  # a template without a generation prompt: the content and what follows it
            start = a
        inner = start
    else:
        start = full.rfind(marks.opener, 0, a) if marks.opener else a
        if start < 0:
            raise TurnNotFound(f"no turn opener {marks.opener!r} before its content")
        inner = start + len(marks.opener)
    end = b
    if marks.footer:
        at = full.find(marks.footer, b)
        if at < 0:
            raise TurnNotFound(f"no end-of-turn marker {marks.footer!r} after its content")
        end = at + len(marks.footer)
    if marks.opener and marks.opener in full[inner:end]:
        raise TurnNotFound(f"its turn would span another turn (a {marks.opener!r} inside it)")
    return start, end
