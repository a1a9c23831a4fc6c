"""`hybridtune data`: the configured data rendered with the chat template, trained text marked, token counts, the
packing summary and the cache key, from the tokenizer alone (no model is built). The output is pinned for one chat
row and one tool-call row."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from hybridtune import cli
from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.infer.data_preview import marked, preview, take_rows
from hybridtune.models.tokenizer_files import bundled_tokenizer

TEMPLATE = Path(__file__).with_name("qwen3_5_chat_template.jinja")
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
CHAT = {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]}
TOOL_CALL = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ],
    "tools": TOOLS,
}

PINNED = """\
data for tiny-qwen3_5's tokenizer, sequence_len 256; trained text between [[ and ]]

DATA: 2 of 3 rows, format 'chat'
--- DATA:1 (chat): 32 tokens, 2 trained
<|im_start|>user
2+2=<|im_end|>
<|im_start|>assistant
<think>

</think>

[[4<|im_end|>]]

--- DATA:2 (chat): 415 tokens, 82 trained; dropped: truncating to sequence_len=256 cut every trained token (159 over)
<|im_start|>system
# Tools

You have access to the following functions:

<tools>
{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
</tools>

To call a function reply with:
<tool_call>
<function=name>
<parameter=arg>
value
</parameter>
</function>
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris?<|im_end|>
<|im_start|>assistant
<think>

</think>

[[<tool_call>
<function=weather>
<parameter=city>
Paris
</parameter>
</function>
</tool_call><|im_end|>]]
<|im_start|>user
<tool_response>
sunny
</tool_response><|im_end|>
<|im_start|>assistant
<think>

</think>

[[Sunny.<|im_end|>]]


packing: 3 training examples -> 1 bins of 256 tokens (25% full), 0 held out; 1 dropped (1 whose truncation cut \
every trained token)
cache key: DATA: KEY
"""


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in (CHAT, TOOL_CALL, CHAT)))
    return p


def config(data, tmp_path, **kw):
    keys = {"dataset": str(data), "val_set_size": 0, "chat_template": str(TEMPLATE), "output_dir": str(tmp_path / "o")}
    return load_config(None, {**keys, "chat_template_kwargs": {"enable_thinking": False}, **kw})


def test_the_preview_of_a_chat_row_and_a_tool_call_row(data, tmp_path, monkeypatch):
    def no_model(*a, **kw):
        raise AssertionError("the preview built a torch module (a model)")

    monkeypatch.setattr(torch.nn.Module, "__init__", no_model)
    out = io.StringIO()
    prepared = preview(config(data, tmp_path), 2, out)
    text = out.getvalue()
    key = prepared.sources[0].key
    assert re.fullmatch(r"[0-9a-f]{64}", key) and text.count(key) == 1
    assert text.replace(str(data), "DATA").replace(key, "KEY") == PINNED


def test_marks_follow_the_loss_mask_token_by_token(data, tmp_path):
    out = io.StringIO()
    prepared = preview(config(data, tmp_path, chat_template_kwargs={}), 0, out)
    tok = bundled_tokenizer()
    ex = prepared.sources[0].examples[0]
    shown = marked(tok, ex.input_ids, ex.loss_mask, color=False)
    trained = tok.decode([t for t, m in zip(ex.input_ids[1:], ex.loss_mask[1:]) if m])
    assert re.findall(r"\[\[(.*?)\]\]", shown, re.S) == [trained] == ["\n</think>\n\n4<|im_end|>"]
    assert marked(tok, ex.input_ids, ex.loss_mask, color=True).count("\x1b[32m") == 1


def test_the_command_is_registered_and_takes_rows(data, tmp_path, capsys):
    argv = ["data", "--dataset", str(data), "--val_set_size", "0", "--rows", "1", "--output_dir", str(tmp_path / "o")]
    argv += ["--chat_template", str(TEMPLATE)]  # the preset's own template ignores the tool-call row's tool calls
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{data}: 1 of 3 rows, format 'chat'" in out and out.count("--- ") == 1
    assert take_rows(["--rows=3", "--x", "1"]) == (3, ["--x", "1"])
    with pytest.raises(ConfigError, match="--rows 'many'"):
        take_rows(["--rows", "many"])
