"""A chat template's work is bounded (data/template_budget.py): nested loops over large ranges, a repetition or a
power that builds something huge, or runaway macro recursion stop with one line naming the row and the template's
line, instead of hanging the command; real templates render as transformers renders them."""

from __future__ import annotations

import contextlib
import copy
import json
import signal
from pathlib import Path

import pytest

from hybridtune.data import template_budget
from hybridtune.data.chat import render
from hybridtune.models.tokenizer_files import bundled_tokenizer

QWEN3_5 = Path(__file__).parents[1] / "data" / "qwen3_5_chat_template.jinja"
ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
NESTED_RANGES = "{% for i in range(100000) %}\n{% for j in range(100000) %}{% endfor %}{% endfor %}"


class Hung(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    """A Hung error after `seconds` (a failing test rather than a suite that never ends)."""

    def hung(signum, frame):
        raise Hung(f"still rendering after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _tok(template: str):
    tok = copy.deepcopy(bundled_tokenizer())
    tok.chat_template = template
    return tok


def test_nested_range_loops_stop_with_one_line_naming_the_row_and_template_line(tmp_path, error_line):
    """The bug this guards: `hybridtune data` / `train` with this template ran for ever (the sandbox caps each
    range at 100,000 items, not their product)."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    template = tmp_path / "slow.jinja"
    template.write_text(NESTED_RANGES)
    argv = ["data", "--dataset", str(data), "--chat_template", str(template), "--val_set_size", "0"]
    with _deadline(60):
        line = error_line([*argv, "--output_dir", str(tmp_path / "out")])
    assert f"{data}:1:" in line and "steps of work" in line and "line 2 of the template" in line
    assert "set chat_template to another" in line


@pytest.mark.parametrize(
    "template",
    [
        "{% set x = [0] * 100000 %}{% for i in x %}{{ x | join }}{% endfor %}",  # a filter over a big list per item
        "{{ 'ab' * 10000000000 }}",  # a repetition: charged for its size before it is built
        "{{ 10 ** (10 ** 10) }}",  # a power with a 33-billion-bit result
        "{{ lipsum(1000000) }}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    ],
)
def test_other_runaway_work_stops(template):
    with pytest.raises(template_budget.TemplateBudgetExceeded, match="steps of work"):
        render(_tok(template), ROW["messages"])


def test_real_templates_render_as_transformers_renders_them():
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    for tok in (_tok(bundled_tokenizer().chat_template), _tok(QWEN3_5.read_text())):
        for with_tools in (None, tools):
            for prompt in (False, True):
                for kwargs in ({}, {"enable_thinking": False}):
                    want = tok.apply_chat_template(
                        messages, tools=with_tools, tokenize=False, add_generation_prompt=prompt, **kwargs
                    )
                    assert render(tok, messages, with_tools, prompt, kwargs) == want


def test_a_long_conversation_stays_far_inside_the_budget(monkeypatch):
    spent = []
    charge = template_budget._charge
    monkeypatch.setattr(template_budget, "_charge", lambda n: (spent.append(n), charge(n)))
    turn = [{"role": "user", "content": "q" * 500}, {"role": "assistant", "content": "a" * 500}]
    render(_tok(QWEN3_5.read_text()), turn * 500)
    assert 0 < sum(spent) < template_budget.STEPS // 50


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_bound_the_template_as_training_does(command, tmp_path, monkeypatch, error_line):
    """The bug this guards: generate and chat rendered prompts through apply_chat_template unbounded, so a model
    directory whose template nests large loops hung them (training stopped in one line)."""
    import io
    import sys

    from checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path, "qwen3_5_text", name="model", chat_template=NESTED_RANGES)
    argv = [command, str(model), "--max_new_tokens", "2"]
    if command == "generate":
        argv += ["--prompt", "hi"]
    else:
        monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    with _deadline(60):
        line = error_line(argv)
    assert "steps of work" in line and "set chat_template to another" in line
