"""A chat template that ignores a row's tool calls, reasoning or tools is refused in one line naming the row, the
field and what to do (data/template_fields.py), instead of training a tool-call turn as `<|im_end|>` alone; a
template that renders them (Qwen3.5's, which keeps only the latest turn's reasoning by design) is not refused, and
the check costs a few renderings per kind of row, not per row."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from hybridtune.config import DatasetConfig
from hybridtune.data import template_fields
from hybridtune.data.examples import load_examples
from hybridtune.data.formats import to_example
from hybridtune.errors import DataError
from hybridtune.models.tokenizer_files import bundled_tokenizer

QWEN3_5 = Path(__file__).parents[1] / "data" / "qwen3_5_chat_template.jinja"
CALL = {"type": "function", "function": {"name": "get_w", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_w", "parameters": {"type": "object", "properties": {}}}}]
# The red-team's row: a turn that only calls a tool, its result, the reply.
TOOL_ROW = {
    "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
}
# Renders tool calls but neither tools nor reasoning.
CALLS_ONLY = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tok(template: str | None = None):
    tok = copy.deepcopy(bundled_tokenizer())
    if template is not None:
        tok.chat_template = template
    return tok


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_presets_template_refuses_a_tool_call_row_in_one_line(tmp_path, error_line):
    """The bug this guards: with the presets' plain ChatML template, `hybridtune data`/`eval`/`train` took this row
    (rc 0) and trained the tool-call turn as `<|im_end|>` alone."""
    data = _jsonl(
        tmp_path / "tools.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, TOOL_ROW],
    )
    line = error_line(["data", "--dataset", str(data), "--val_set_size", "0", "--output_dir", str(tmp_path / "o")])
    assert line.startswith(f"error: {data}:2: message 1 (role 'assistant') has 'tool_calls', but the chat template")
    assert "set `chat_template` to a template that renders tool_calls, or drop the field from the data" in line


@pytest.mark.parametrize(
    "row, template, said",
    [
        (  # reasoning on the last turn, where every reasoning template renders it
            {
                "messages": [
                    {"role": "user", "content": "2+2="},
                    {"role": "assistant", "content": "4", "reasoning_content": "Add."},
                ]
            },
            None,
            "message 1 (role 'assistant') has 'reasoning_content'",
        ),
        ({**TOOL_ROW, "tools": TOOLS}, CALLS_ONLY, "the row's 'tools'"),
        (TOOL_ROW, None, "message 1 (role 'assistant') has 'tool_calls'"),
    ],
)
def test_each_ignored_field_is_named(row, template, said):
    with pytest.raises(DataError, match=re.escape(f"row 1: {said}, but the chat template renders the same text")):
        to_example(row, "chat", _tok(template), DatasetConfig(), False, "row 1")


def test_templates_that_render_the_fields_are_not_refused():
    qwen = _tok(QWEN3_5.read_text())
    # Qwen3.5's template drops the reasoning of turns before the last query (as served): not refused for that.
    early = {
        "messages": [
            {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4", "reasoning_content": "Add."},
            {"role": "user", "content": "3+3="},
            {"role": "assistant", "content": "6"},
        ]
    }
    for row in (early, {**TOOL_ROW, "tools": TOOLS}):
        ex = to_example(row, "chat", qwen, DatasetConfig(), False, "row 1")
        assert sum(ex.loss_mask) > 0
    ex = to_example(TOOL_ROW, "chat", _tok(CALLS_ONLY), DatasetConfig(), False, "row 1")
    trained = _tok().decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert "<tool_call>get_w</tool_call><|im_end|>" in trained


def test_the_check_renders_once_per_kind_of_row_not_per_row(tmp_path, monkeypatch):
    decided = []
    differs = template_fields._differs
    monkeypatch.setattr(template_fields, "_DECIDED", {})
    monkeypatch.setattr(template_fields, "_differs", lambda *a: decided.append(a) or differs(*a))
    row = {**TOOL_ROW, "tools": TOOLS}
    row["messages"] = [
        *row["messages"][:1],
        {**row["messages"][1], "reasoning_content": "Call it."},
        *row["messages"][2:],
    ]
    data = _jsonl(tmp_path / "d.jsonl", [row] * 40)
    examples = load_examples(DatasetConfig(path=str(data)), _tok(QWEN3_5.read_text()), cache=False, num_proc=1)
    assert len(examples) == 40
    assert len(decided) == 3  # tools, and the assistant's tool_calls and reasoning_content: once each
