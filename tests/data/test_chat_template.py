"""Chat data with templates that do not render prefix-stably (Qwen3.5's drops earlier <think> blocks): the mask
covers exactly the assistant turns as rendered in the whole conversation, token by token; the `chat_template` key;
TRL's prompt/completion rows."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hybridtune.config import DatasetConfig, load_config
from hybridtune.data.chat import chat_spans, with_chat_template
from hybridtune.data.examples import load_examples
from hybridtune.data.formats import detect_type, to_example
from hybridtune.errors import ConfigError, DataError
from hybridtune.models.tokenizer_files import bundled_tokenizer

QWEN3_5_TEMPLATE = Path(__file__).with_name("qwen3_5_chat_template.jinja")
# Qwen3.5's tokenizer has these as added tokens; the bundled one splits them into bytes. Both are tested.
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The forecast for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]

# A real Qwen3.5-style agent conversation: system, tools, a thinking tool call whose arguments are an OpenAI JSON
# string and whose content is null, a tool result, a reply with its <think> block inside the content, a second
# query, a thinking reply with content and a tool call, two grouped tool results, a non-thinking reply as content
# parts. The first two assistant turns come before the last user query, so the template drops their reasoning.
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I should call the tool.",
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}
        ],
    },
    {"role": "tool", "content": "sunny, 21C"},
    {"role": "assistant", "content": "<think>\nThe tool said sunny.\n</think>\n\nSunny, 21C."},
    {"role": "user", "content": "And tomorrow?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Call it again for one day.",
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "days": 1}}}
        ],
    },
    {"role": "tool", "content": "rain"},
    {"role": "tool", "content": "wind"},
    {"role": "assistant", "content": [{"type": "text", "text": "Rain "}, {"type": "text", "text": "and wind."}]},
]

# What each assistant turn trains, written out by hand from the template: from after the generation header as the
# turn renders (`<|im_start|>assistant\n`, plus `<think>\n` where the block is kept) through `<|im_end|>`.
CALL_PARIS_2 = (
    "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>"
)
EXPECTED_TRAINED = [
    CALL_PARIS_2,  # reasoning dropped (before the last query); the JSON-string arguments rendered as parameters
    "Sunny, 21C.<|im_end|>",  # the <think> block of its content dropped
    "Call it again for one day.\n</think>\n\nChecking.\n\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>",
    "\n</think>\n\nRain and wind.<|im_end|>",  # no reasoning: the empty block after the prompt's `<think>\n`
]


def as_rendered(messages: list[dict]) -> list[dict]:
    """The messages as hybridtune hands them to the template: content parts joined, a null content empty, tool-call
    arguments given as JSON strings parsed (this template iterates them as a mapping)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m["content"], list):
            m["content"] = "".join(p["text"] for p in m["content"])
        m["content"] = m["content"] or ""
        if "tool_calls" in m:
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                if isinstance(c["function"]["arguments"], str)
                else c
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def qwen_tokenizer(added: bool):
    tok = copy.deepcopy(bundled_tokenizer())
    tok.chat_template = QWEN3_5_TEMPLATE.read_text()
    if added:
        tok.add_tokens(QWEN_ADDED)
    return tok


@pytest.fixture(scope="module", params=[False, True], ids=["bytes", "added-tokens"])
def qwen(request):
    return qwen_tokenizer(request.param)


def expected_mask(tok, rendered: str, input_ids: list[int], trained: list) -> list[int]:
    """The reference mask: locate each expected trained text in order in the rendering (plain string search; a
    pair (before, text) finds `text` right after `before`), then a token is trained when its first character lies
    in one of those ranges."""
    ranges, pos = [], 0
    for item in trained:
        before, text = item if isinstance(item, tuple) else ("", item)
        at = rendered.index(before + text, pos) + len(before)
        ranges.append((at, at + len(text)))
        pos = at + len(text)
    offsets = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == len(input_ids)
    return [int(any(a <= s < b for a, b in ranges)) for s, _ in offsets]


def test_the_template_is_not_prefix_stable(qwen):
    whole = qwen.apply_chat_template(as_rendered(CONVERSATION), tools=TOOLS, tokenize=False)
    first_turns = qwen.apply_chat_template(as_rendered(CONVERSATION[:5]), tools=TOOLS, tokenize=False)
    assert "The tool said sunny." in first_turns and "The tool said sunny." not in whole
    assert not whole.startswith(first_turns)


def test_qwen3_5_conversation_masks_exactly_the_assistant_turns(qwen):
    ex = to_example({"messages": CONVERSATION, "tools": TOOLS}, "chat", qwen, DatasetConfig(), False, "x")
    rendered = qwen.apply_chat_template(as_rendered(CONVERSATION), tools=TOOLS, tokenize=False)
    # The example is the whole conversation as the template renders it, tokenised once.
    assert ex.input_ids == qwen(rendered, add_special_tokens=False)["input_ids"]
    assert ex.loss_mask == expected_mask(qwen, rendered, ex.input_ids, EXPECTED_TRAINED)
    # Nothing else: no system, tools block, user turn, tool result, header or newline after <|im_end|>.
    untrained = qwen.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if not m])
    for prompt_text in (
        "You are terse.",
        "Weather in Paris?",
        "sunny, 21C",
        "rain",
        "wind",
        "And tomorrow?",
        "<tools>",
    ):
        assert prompt_text in untrained
    assert untrained.count("<|im_start|>assistant\n") == 4


def test_thinking_turns_after_the_last_query_keep_their_reasoning(qwen):
    # A multi-step tool loop after the only query: every assistant turn is after it, so all keep <think>.
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use the tool.",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "snow"},
        {"role": "assistant", "content": "<think>It snows.</think>Snow."},
    ]
    ex = to_example({"messages": messages}, "chat", qwen, DatasetConfig(), False, "x")
    rendered = qwen.decode(ex.input_ids)
    trained = [
        "Use the tool.\n</think>\n\n<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>",
        "It snows.\n</think>\n\nSnow.<|im_end|>",
    ]
    assert rendered.count("<think>\n") == 2
    assert ex.loss_mask == expected_mask(qwen, rendered, ex.input_ids, trained)


def test_non_thinking_reply_and_alpaca_with_the_qwen_template(qwen):
    # The generation prompt opens `<think>\n`; a reply without reasoning trains the empty block's close, so the
    # model learns to answer after the prompt it gets at inference.
    row = {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]}
    ex = to_example(row, "chat", qwen, DatasetConfig(), False, "x")
    rendered = qwen.decode(ex.input_ids)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")
    assert ex.loss_mask == expected_mask(qwen, rendered, ex.input_ids, ["\n</think>\n\n4<|im_end|>"])
    alpaca = to_example({"instruction": "2+2=", "output": "4"}, "alpaca", qwen, DatasetConfig(), False, "x")
    assert alpaca == ex


def test_trained_tool_results_train_their_grouped_turn(qwen):
    # roles_to_train [assistant, tool]: the two tool results share one rendered user turn, trained once, whole.
    ds = DatasetConfig(roles_to_train=["assistant", "tool"])
    ex = to_example({"messages": CONVERSATION, "tools": TOOLS}, "chat", qwen, ds, False, "x")
    rendered = qwen.apply_chat_template(as_rendered(CONVERSATION), tools=TOOLS, tokenize=False)
    trained = list(EXPECTED_TRAINED)
    trained.insert(1, "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>")
    trained.insert(
        4,
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\nwind\n</tool_response><|im_end|>",
    )
    assert ex.loss_mask == expected_mask(qwen, rendered, ex.input_ids, trained)


def test_spans_concatenate_to_the_rendering_and_train_on_inputs_trains_all(qwen):
    spans = chat_spans(qwen, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], [False, True])
    assert "".join(s for s, _ in spans) == qwen.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert [s for s, t in spans if t] == ["\n</think>\n\nyo<|im_end|>"]
    row = {"messages": CONVERSATION, "tools": TOOLS}
    assert all(to_example(row, "chat", qwen, DatasetConfig(), True, "x").loss_mask)


def test_tools_as_a_json_string_column_and_null_fields_from_arrow(qwen, tmp_path):
    # datasets/Arrow give every message every field of the column (null where absent) and often store tools as
    # a JSON string; both load the same example as the plain row.
    keys = {"role", "content", "reasoning_content", "tool_calls"}
    arrow_like = [{k: m.get(k) for k in keys} for m in CONVERSATION]
    a = to_example({"messages": arrow_like, "tools": json.dumps(TOOLS)}, "chat", qwen, DatasetConfig(), False, "x")
    b = to_example({"messages": CONVERSATION, "tools": TOOLS}, "chat", qwen, DatasetConfig(), False, "x")
    assert a == b


def test_a_turn_that_cannot_be_located_is_one_line_naming_file_and_line(tmp_path):
    tok = copy.deepcopy(bundled_tokenizer())
    # Earlier assistant replies are not rendered at all: there is nothing to train for them.
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role != 'assistant' or loop.last %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    two_turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"messages": two_turns[2:]}) + "\n" + json.dumps({"messages": two_turns}) + "\n")
    with pytest.raises(DataError) as e:
        load_examples(DatasetConfig(path=str(p)), tok)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{p}:2: cannot locate message 1 (role 'assistant') in the rendered conversation")
    assert "chat_template" in msg


def test_template_that_refuses_the_probe_falls_back_to_the_conversation():
    tok = copy.deepcopy(bundled_tokenizer())
    tok.chat_template = (
        "{%- if messages[0].role != 'system' %}{{- raise_exception('system first') }}{%- endif %}"
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "r"}]
    assert [s for s, t in chat_spans(tok, msgs, [False, False, True]) if t] == ["r<|im_end|>"]


def test_llama3_style_template_with_header_tokens():
    tok = copy.deepcopy(bundled_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = (
        "{%- for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim"
        " + '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    )
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": " r1 "}]
    msgs += [{"role": "user", "content": "v"}, {"role": "assistant", "content": "r2"}]
    assert [s for s, t in chat_spans(tok, msgs, [False, True, False, True]) if t] == ["r1<|eot_id|>", "r2<|eot_id|>"]
    # A trained user role trains its whole turn, header included.
    assert [s for s, t in chat_spans(tok, msgs, [True, False, False, False]) if t] == [
        "<|start_header_id|>user<|end_header_id|>\n\nu<|eot_id|>"
    ]


# --- the chat_template key ----------------------------------------------------------------------------------


def test_chat_template_from_a_file_leaves_the_bundled_tokenizer_alone():
    base = bundled_tokenizer()
    before = base.chat_template
    tok = with_chat_template(base, str(QWEN3_5_TEMPLATE))
    assert tok.chat_template == QWEN3_5_TEMPLATE.read_text() and base.chat_template == before
    assert with_chat_template(base, None) is base
    ex = to_example(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        "chat",
        tok,
        DatasetConfig(),
        False,
        "x",
    )
    assert "<think>" in tok.decode(ex.input_ids)


def test_chat_template_by_name_and_its_errors(tmp_path):
    tok = copy.deepcopy(bundled_tokenizer())
    tok.chat_template = {"default": bundled_tokenizer().chat_template, "qwen3_5": QWEN3_5_TEMPLATE.read_text()}
    assert with_chat_template(tok, "qwen3_5").chat_template == QWEN3_5_TEMPLATE.read_text()
    with pytest.raises(
        ConfigError, match=r"'qwen35' is neither a file nor a named template .*: default, qwen3_5\); give"
    ):
        with_chat_template(tok, "qwen35")
    with pytest.raises(ConfigError, match="it has no named templates"):
        with_chat_template(bundled_tokenizer(), "tool_use")
    with pytest.raises(ConfigError, match=r"chat_template: file '.*nope\.jinja' does not exist"):
        with_chat_template(tok, str(tmp_path / "nope.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n")
    with pytest.raises(ConfigError, match=r"bad\.jinja' is not a valid Jinja template \(line 2: "):
        with_chat_template(tok, str(bad))


def test_a_checkpoints_own_and_named_templates_from_disk(tmp_path):
    # A checkpoint's tokenizer as transformers saves it: chat_template.jinja (its own template, used by default)
    # and additional_chat_templates/<name>.jinja (named ones, chosen with `chat_template: <name>`).
    from hybridtune.models.loading import load_tokenizer

    tok = copy.deepcopy(bundled_tokenizer())
    tok.chat_template = {"default": QWEN3_5_TEMPLATE.read_text(), "plain": bundled_tokenizer().chat_template}
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "additional_chat_templates" / "plain.jinja").is_file()
    own = load_tokenizer(str(tmp_path), None)
    row = {"messages": CONVERSATION, "tools": TOOLS}
    ex = to_example(row, "chat", own, DatasetConfig(), False, "x")
    rendered = own.apply_chat_template(as_rendered(CONVERSATION), tools=TOOLS, tokenize=False)
    assert ex.loss_mask == expected_mask(own, rendered, ex.input_ids, EXPECTED_TRAINED)
    # The plain ChatML template ignores tools, tool calls and reasoning: such a row is refused with it (it trained the
    # tool call's turn as its end-of-turn marker alone), a row of plain turns is not.
    plain = with_chat_template(own, "plain")
    with pytest.raises(DataError, match="^x: the row's 'tools', but the chat template renders the same text without"):
        to_example(row, "chat", plain, DatasetConfig(), False, "x")
    with pytest.raises(DataError, match="^x: message 2 \\(role 'assistant'\\) has 'tool_calls'"):
        to_example({"messages": CONVERSATION}, "chat", plain, DatasetConfig(), False, "x")
    turns = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION if isinstance(m["content"], str)]
    ex = to_example({"messages": turns}, "chat", plain, DatasetConfig(), False, "x")
    assert plain.decode(ex.input_ids) == plain.apply_chat_template(turns, tokenize=False)


def test_chat_template_is_a_config_key(tmp_path):
    cfg = load_config(overrides={"chat_template": str(QWEN3_5_TEMPLATE)})
    assert cfg.chat_template == str(QWEN3_5_TEMPLATE)


# --- TRL prompt/completion ------------------------------------------------------------------------------------


def test_prompt_completion_as_text_trains_the_completion():
    tok = bundled_tokenizer()
    row = {"prompt": "The sky is", "completion": " blue."}
    assert detect_type(row, DatasetConfig(), "x") == "prompt_completion"
    ex = to_example(row, "prompt_completion", tok, DatasetConfig(), False, "x")
    assert tok.decode(ex.input_ids) == "The sky is blue.<|im_end|>"  # no chat template, as TRL
    assert tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m]) == " blue.<|im_end|>"


def test_conversational_prompt_completion_trains_the_completion_turns(qwen):
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
        "completion": [{"role": "assistant", "content": "4", "reasoning_content": "Add."}],
    }
    assert detect_type(row, DatasetConfig(), "x") == "prompt_completion"
    ex = to_example(row, "prompt_completion", qwen, DatasetConfig(), False, "x")
    rendered = qwen.decode(ex.input_ids)
    assert ex.loss_mask == expected_mask(qwen, rendered, ex.input_ids, ["Add.\n</think>\n\n4<|im_end|>"])


def test_prompt_completion_errors(tmp_path):
    tok = bundled_tokenizer()
    p = tmp_path / "pc.jsonl"
    rows = [
        {"prompt": "a", "completion": "b"},
        {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError, match=r"pc\.jsonl:2: 'prompt' is a string and 'completion' is a list; give both"):
        load_examples(DatasetConfig(path=str(p)), tok)
    p.write_text(json.dumps({"prompt": "a", "completion": None}) + "\n")
    with pytest.raises(DataError, match=r"pc\.jsonl:1: prompt_completion row has field 'completion' but it is null"):
        load_examples(DatasetConfig(path=str(p)), tok)
    p.write_text(json.dumps({"prompt": [{"role": "user", "content": [{"type": "image_url"}]}], "completion": []}))
    with pytest.raises(
        DataError, match=r"pc\.jsonl:1: message 0 \(role 'user'\), key 'content': content part 0 has type"
    ):
        load_examples(DatasetConfig(path=str(p)), tok)


def test_bad_tool_fields_are_errors(qwen):
    base = [{"role": "user", "content": "q"}]
    cases = [
        (
            {"messages": base + [{"role": "assistant", "content": "", "tool_calls": "weather()"}]},
            "'tool_calls' must be a list",
        ),
        (
            {"messages": base + [{"role": "assistant", "content": "a", "reasoning_content": 3}]},
            "'reasoning_content' must be text",
        ),
        (
            {"messages": base + [{"role": "assistant", "content": "a"}], "tools": "not json"},
            "'tools' is a string but not JSON",
        ),
        ({"messages": base + [{"role": "assistant", "content": "a"}], "tools": {"a": 1}}, "'tools' must be a list"),
    ]
    for row, match in cases:
        with pytest.raises(DataError, match=rf"^x: .*{match}"):
            to_example(row, "chat", qwen, DatasetConfig(), False, "x")


# --- end to end: the key through `hybridtune train` --------------------------------------------------------


def train_args(tmp_path) -> list[str]:
    data = tmp_path / "agent.jsonl"
    rows = [{"messages": CONVERSATION, "tools": TOOLS}] * 6 + [{"messages": CONVERSATION[:5]}] * 6
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = ["train", "--dataset", str(data), "--sequence_len", "512", "--max_steps", "2", "--eval_steps", "0"]
    return [*args, "--warmup_steps", "1", "--val_set_size", "2", "--output_dir", str(tmp_path / "run")]


def test_a_missing_chat_template_is_one_line(tmp_path, capsys):
    from hybridtune.cli import main

    assert main([*train_args(tmp_path), "--chat_template", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "chat_template: file '" in err and "missing.jinja' does not exist" in err


@pytest.mark.slow  # trains two steps in this process and loads the export (~10-20 s on 2 cores)
def test_train_with_a_chat_template_file_saves_it_with_the_model(tmp_path):
    from transformers import AutoTokenizer

    from hybridtune.cli import main

    assert main([*train_args(tmp_path), "--chat_template", str(QWEN3_5_TEMPLATE)]) == 0
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "run" / "final"))
    assert saved.chat_template == QWEN3_5_TEMPLATE.read_text()
