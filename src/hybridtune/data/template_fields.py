"""Fields a chat template must render when a row carries them: `tool_calls` and `reasoning_content` of a message, the
row's `tools`. A template that does not render one (a plain ChatML template, the tiny presets') would drop it
silently: a turn that only calls a tool would train as its end-of-turn marker alone. The test is the rendering itself:
the conversation up to the message with and without the field (the message last, where a template that keeps only
the latest reasoning renders it), or with and without `tools`; the same text means the template ignores it.

Each (template, keyword arguments, field, role) is decided once per process and kept, so the cost is a few renderings
per kind of row, not per row.
"""

from __future__ import annotations

import json

FIELDS = ("tool_calls", "reasoning_content")
_LOST = {
    "tool_calls": "its tool calls would be lost (a turn that only calls a tool trains as its end-of-turn marker alone)",
    "reasoning_content": "its reasoning would not be trained",
    "tools": "the model would not see the tool definitions it is trained to call",
}
# (template, tools given, keyword arguments, field, role) -> whether the template renders the field
_DECIDED: dict[tuple, bool] = {}


class FieldNotRendered(ValueError):
    """A row's field that the chat template ignores (the message names the field, the message and what to do)."""


def check_rendered(tokenizer, messages: list[dict], tools: list | None, kw: dict, render) -> None:
    """FieldNotRendered when the template renders `messages` (with `tools`) the same without one of their non-empty
    tool_calls or reasoning_content, or without the row's non-empty `tools`. `render(messages, tools)` renders as the
    caller does (with `kw`)."""
    kwargs = json.dumps(kw, sort_keys=True, default=str)
    if tools:
        key = (tokenizer.get_chat_template(None, tools), True, kwargs, "tools", "")
        if key not in _DECIDED:
            _keep(key, _differs(render, (messages, None), (messages, tools)))
        if not _DECIDED[key]:
            raise FieldNotRendered(_message("tools", "the row's 'tools'"))
    template = tokenizer.get_chat_template(None, tools)
    for j, m in enumerate(messages):
        for field in (f for f in FIELDS if m.get(f)):
            key = (template, bool(tools), kwargs, field, m["role"])
            if key not in _DECIDED:
                without = [*messages[:j], {k: v for k, v in m.items() if k != field}]
                _keep(key, _differs(render, (without, tools), (messages[: j + 1], tools)))
            if not _DECIDED[key]:
                raise FieldNotRendered(_message(field, f"message {j} (role {m['role']!r}) has {field!r}"))


def _keep(key: tuple, renders: bool) -> None:
    if len(_DECIDED) > 256:
        _DECIDED.clear()
    _DECIDED[key] = renders


def _differs(render, without: tuple, with_field: tuple) -> bool:
    """Whether the two renderings differ; a template that cannot render one of them is taken to use the field (its
    own error, if any, comes from the conversation's rendering)."""
    try:
        return render(*without) != render(*with_field)
    except Exception:
        return True


def _message(field: str, what: str) -> str:
    return (
        f"{what}, but the chat template renders the same text without it, so {_LOST[field]}; set `chat_template` "
        f"to a template that renders {field}, or drop the field from the data"
    )
