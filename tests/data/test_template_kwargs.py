"""`chat_template_kwargs` (Qwen3.5's `enable_thinking: false`): the train key reaches every rendering of the data, the
masking still checked token by token against the template's own output; generate, chat and eval take it as
`--chat_template_kwargs JSON`; apply_chat_template's own arguments are refused."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest

from hybridtune.config import DatasetConfig, load_config
from hybridtune.data.build import prepare
from hybridtune.data.formats import to_example
from hybridtune.errors import ConfigError
from hybridtune.infer import chat as chat_command
from hybridtune.infer import generate as generate_command
from hybridtune.infer.evaluate import eval_examples
from hybridtune.infer.load import Opened
from hybridtune.models.tokenizer_files import bundled_tokenizer
from hybridtune.runtime import generation

TEMPLATE = Path(__file__).with_name("qwen3_5_chat_template.jinja")
NO_THINKING = {"enable_thinking": False}
ROW = {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]}


@pytest.fixture(scope="module")
def qwen():
    tok = copy.deepcopy(bundled_tokenizer())
    tok.chat_template = TEMPLATE.read_text()
    return tok


def mask_of(tok, rendered: str, trained: str) -> list[int]:
    """The reference: a token is trained when its first character lies in the last occurrence of `trained`."""
    at = rendered.rindex(trained)
    offsets = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [int(at <= s < at + len(trained)) for s, _ in offsets]


def test_enable_thinking_false_trains_the_reply_after_the_empty_think_block(qwen):
    prompt = qwen.apply_chat_template(ROW["messages"][:1], tokenize=False, add_generation_prompt=True, **NO_THINKING)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # what the model sees when generating
    ex = to_example(ROW, "chat", qwen, DatasetConfig(), False, "x", template_kwargs=NO_THINKING)
    rendered = qwen.decode(ex.input_ids)
    assert rendered == qwen.apply_chat_template(ROW["messages"], tokenize=False, **NO_THINKING)
    assert ex.input_ids == qwen(rendered, add_special_tokens=False)["input_ids"]
    # The generation prompt holds the empty block, so only the reply and its end of turn are trained ...
    assert ex.loss_mask == mask_of(qwen, rendered, "4<|im_end|>")
    # ... where the default prompt opens `<think>\n` and the reply trains the block's close too.
    default = to_example(ROW, "chat", qwen, DatasetConfig(), False, "x")
    assert default.input_ids == ex.input_ids
    assert default.loss_mask == mask_of(qwen, rendered, "\n</think>\n\n4<|im_end|>")


def test_a_reasoning_reply_under_enable_thinking_false_keeps_its_reasoning_trained(qwen):
    row = {"messages": [ROW["messages"][0], {"role": "assistant", "content": "4", "reasoning_content": "Add."}]}
    ex = to_example(row, "chat", qwen, DatasetConfig(), False, "x", template_kwargs=NO_THINKING)
    rendered = qwen.decode(ex.input_ids)
    assert ex.loss_mask == mask_of(qwen, rendered, "Add.\n</think>\n\n4<|im_end|>")


def test_the_train_key_reaches_the_data_and_its_cache_key(qwen, tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(ROW) + "\n" + json.dumps(ROW) + "\n")
    keys = {"dataset": str(p), "val_set_size": 0, "output_dir": str(tmp_path / "o")}
    on = prepare(load_config(None, {**keys, "chat_template_kwargs": NO_THINKING}), qwen)
    off = prepare(load_config(None, keys), qwen)
    want = to_example(ROW, "chat", qwen, DatasetConfig(), False, "x", template_kwargs=NO_THINKING)
    assert [e for b in on.bins for e in b] == [want, want]
    assert [e for b in off.bins for e in b] != [want, want]
    assert on.sources[0].key != off.sources[0].key
    # eval reads the data the same way (a run's key, or --chat_template_kwargs)
    examples, _ = eval_examples(load_config(None, {**keys, "chat_template_kwargs": NO_THINKING}), qwen, "all")
    assert examples == [want, want]


@pytest.mark.parametrize("kwargs", [{"tools": []}, {"add_generation_prompt": True}, {"1x": 1}])
def test_apply_chat_template_arguments_are_refused(qwen, tmp_path, kwargs):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(ROW) + "\n")
    cfg = load_config(None, {"dataset": str(p), "chat_template_kwargs": kwargs, "output_dir": str(tmp_path / "o")})
    with pytest.raises(ConfigError, match="chat_template_kwargs: "):
        prepare(cfg, qwen)


def test_generate_and_chat_render_with_the_option(qwen, monkeypatch, capsys):
    seen: list[str] = []

    def complete(model, tokenizer, texts, *a, **kw):
        seen.extend(texts)
        return [(tokenizer("ok<|im_end|>", add_special_tokens=False)["input_ids"], "stop") for _ in texts]

    monkeypatch.setattr(generation, "complete", complete)
    monkeypatch.setattr(chat_command, "complete", complete)
    opened = Opened(model=None, tokenizer=qwen, kind="named", name="m", path=None)  # a text model: no vision
    monkeypatch.setattr(generate_command, "open_for_generation", lambda args: opened)
    monkeypatch.setattr(chat_command, "open_for_generation", lambda args: opened)
    flag = ["--chat_template_kwargs", '{"enable_thinking": false}']
    assert generate_command.main(["m", "--prompt", "2+2=", *flag]) == 0
    assert generate_command.main(["m", "--prompt", "2+2="]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("2+2=\n"))
    assert chat_command.main(["m", *flag]) == 0
    empty, opened_block = (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "2+2=<|im_end|>\n<|im_start|>assistant\n<think>\n",
    )
    assert [t.endswith(e) for t, e in zip(seen, [empty, opened_block, empty])] == [True, True, True]
    assert capsys.readouterr().out.count("ok") == 3


def test_the_option_names_a_bad_value(capsys):
    with pytest.raises(SystemExit):
        generate_command.main(["m", "--prompt", "x", "--chat_template_kwargs", '{"tools": 1}'])
    assert "--chat_template_kwargs: the object: tools is set by hybridtune itself" in capsys.readouterr().err
