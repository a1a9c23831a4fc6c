"""Dataset rows -> (input_ids, loss_mask).

Formats: `text` (train on everything), `alpaca` (instruction/input/output; train on the output),
`chat` (a list of {role, content} rendered by the tokenizer's chat template; train on assistant
turns; OpenAI-style messages with tool_calls, role "tool", reasoning_content and a row's `tools`),
`sharegpt` (conversations of {from, value}, mapped onto chat roles), `prompt_completion` (TRL's:
prompt and completion as two texts, or as two lists of messages; train on the completion).
Reading the rows is data/sources.py's (through `datasets`), tokenising them in bulk and caching data/examples.py's; locating
turns in a rendered chat is data/chat.py's; a row's JSON-text cells and media checks data/rows.py's.

Errors name the file, the line (JSONL) or row (Parquet), the field, and what to do.
"""

from __future__ import annotations

import bisect
import json
import logging
from typing import Any

from hybridtune.config import DatasetConfig
from hybridtune.data.chat import TurnNotFound, chat_spans
from hybridtune.data.images import is_image_part
from hybridtune.data.packing import Example
from hybridtune.data.rows import (
    IMAGE_PLACEHOLDER,
    decode_json_cells,
    json_fields,
    message_keys,
    messages_key,
    not_json,
    refuse_media,
    used_fields,
)
from hybridtune.data.template_budget import TemplateBudgetExceeded
from hybridtune.data.template_fields import FieldNotRendered
from hybridtune.data.video import is_video_part
from hybridtune.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# Roles that chat templates render; a role outside these (and outside `roles_to_train`) is a typo or a foreign schema.
CHAT_ROLES = ("assistant", "system", "tool", "user")
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def _json_kind(value: Any) -> str:
    """How JSON calls a value's type, with an article: 'null', 'a list', 'an object', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def field_text(value: Any, where: str, what: str) -> str:
    """A field that becomes training text: a string, or a whole number (its digits). Anything else is an error:
    `str()` of null, a list or an object would train 'None' or a Python repr."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    shown = "" if value is None else f" ({_shown(value)})"
    raise DataError(
        f"{where}: {what} must be text, got {_json_kind(value)}{shown}; write it as a string or drop the row"
    )


def message_content(value: Any, where: str, what: str, images=None) -> str:
    """A chat message's content: text, or a list of content parts (joined in order), as OpenAI-style messages carry
    it: `{"type": "text", "text": ...}`, and image parts where `images` (data/vision.py's `RowImages`: a
    vision-language model's) records them and gives the text that stands for each (as for `<image>` in a text)."""
    if not isinstance(value, (list, tuple)):
        text = field_text(value, where, what)
        return images.text(text, where, what) if images is not None else text
    texts = []
    for k, part in enumerate(value):
        if not isinstance(part, dict):
            raise DataError(
                f"{where}: {what}: content part {k} is {_json_kind(part)} ({_shown(part)}); "
                'expected {"type": "text", "text": ...}'
            )
        if images is not None and (is_image_part(part) or is_video_part(part)):
            texts.append(images.part(part, where, f"{what}, content part {k} ({part['type']})"))
            continue
        if part.get("type") != "text":
            raise DataError(
                f"{where}: {what}: content part {k} has type {part.get('type')!r}; only parts of type 'text' "
                "can be trained on: drop the part or the row"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise DataError(
                f"{where}: {what}: content part {k} has type 'text' but its 'text' is {_json_kind(text)}; "
                "give it a string"
            )
        texts.append(text)
    return "".join(texts)


def refuse_trained_media(content: Any, where: str, what: str, role: str) -> None:
    """One DataError when a trained message's content holds an image or a video (a part, or an `<image>`
    placeholder): its vision start and end tokens would be trained, and the model would learn to begin replies with
    vision tokens it cannot fill."""
    parts = content if isinstance(content, (list, tuple)) else [content]
    for k, part in enumerate(parts):
        found = (
            f"content part {k} ({part['type']})" if is_image_part(part) or is_video_part(part)
            else f"an {IMAGE_PLACEHOLDER} placeholder" if isinstance(part, str) and IMAGE_PLACEHOLDER in part
            else f"an {IMAGE_PLACEHOLDER} placeholder in content part {k}"
            if isinstance(part, dict) and IMAGE_PLACEHOLDER in str(part.get("text", ""))
            else None
        )  # fmt: skip
        if found:
            fix = (  # (a user turn trained by roles_to_train: moving the image "into a user turn" would not help)
                "move the image or video into a user turn, or drop it" if role == "assistant"
                else f"drop '{role}' from the dataset's roles_to_train, or drop the image or video"
            )  # fmt: skip
            raise DataError(
                f"{where}: {what}: {found} is media in a trained turn (role '{role}'): the model would learn to emit "
                f"vision tokens it cannot fill; {fix}"
            )


def detect_type(row: dict, ds: DatasetConfig, where: str) -> str:
    """The format of a row from its fields (a list of messages may be a cell's JSON text)."""
    row = decode_json_cells(row, json_fields("auto", ds))
    for key in message_keys(ds):
        msgs = row.get(key)
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict):
            return "sharegpt" if "from" in msgs[0] and "value" in msgs[0] else "chat"
        if isinstance(msgs, str):
            raise DataError(
                f"{where}: field '{key}' must be a list of messages, got a string that is {not_json(msgs)} "
                f"({_shown(msgs)!r}); give a list of {{role, content}} objects, or its JSON text in a CSV cell"
            )
    if ds.field_prompt in row and ds.field_completion in row:
        return "prompt_completion"
    if ds.field_instruction in row and ds.field_output in row:
        return "alpaca"
    if ds.field_text in row:
        return "text"
    half = [k for k in (ds.field_chosen, ds.field_rejected) if k in row]
    if half:  # (a preference row has both: data/pairs.py `is_preference`)
        other = ds.field_rejected if half[0] == ds.field_chosen else ds.field_chosen
        raise DataError(
            f"{where}: the row has '{half[0]}' but no '{other}' (fields {sorted(row)}); a preference pair "
            f"(dpo, simpo, orpo) needs both, with an optional '{ds.field_prompt}'"
        )
    raise DataError(
        f"{where}: cannot tell the format from fields {sorted(row)}; expected 'messages' (chat), "
        f"'conversations' (sharegpt), 'prompt'+'completion' (prompt_completion), 'instruction'+'output' (alpaca), "
        f"'text', or '{ds.field_chosen}'+'{ds.field_rejected}' (preference pairs for dpo, simpo, orpo); or set "
        "`type` / `--dataset_type`"
    )


def _field(row: dict, key: str, where: str, fmt: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: {fmt} row has no field '{key}' (fields: {sorted(row)}); map it with `field_*` keys")
    if row[key] is None:
        raise DataError(f"{where}: {fmt} row has field '{key}' but it is null; give it a value or drop the row")
    return row[key]


def _tokenize_spans(tokenizer, spans: list[tuple[str, bool]]) -> Example:
    """Tokenize the concatenated text once; a token is trained on if it starts inside a trained span."""
    text = "".join(s for s, _ in spans)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts, trains = [], []
    pos = 0
    for s, train in spans:
        starts.append(pos)
        trains.append(train)
        pos += len(s)
    mask = []
    for start, end in enc["offset_mapping"]:
        # Attribute each token to the span holding its first character (byte-level BPE may merge across a
        # boundary: '<think>\n' + '\n</think>' is one '\n\n' token, left with the untrained header).
        trained = end > start and trains[bisect.bisect_right(starts, start) - 1]
        mask.append(1 if trained else 0)
    return Example(list(enc["input_ids"]), mask)


def parse_messages(
    raw: Any, fmt: str, ds: DatasetConfig, where: str, key: str, images=None, trained: bool | None = None
) -> list[dict]:
    """A row's list of messages as the chat template takes them: role (sharegpt's mapped), content as text, and
    the other fields (tool_calls, reasoning_content, tool_call_id, name, ...) passed on; null fields dropped
    (Arrow gives every message every field of the column). `trained`: whether every message is trained (a
    completion's, a prompt's), else by its role (`roles_to_train`); a trained message holding media is refused."""
    role_key, content_key = ds.message_field_role, ds.message_field_content
    if fmt == "sharegpt" and role_key == "role":
        role_key, content_key = "from", "value"
    if not isinstance(raw, list) or not raw:
        got = "an empty list" if isinstance(raw, list) else _json_kind(raw)
        if isinstance(raw, str):
            got += f" that is {not_json(raw)} ({_shown(raw)!r})"
        raise DataError(
            f"{where}: field '{key}' must be a non-empty list of messages, got {got}; give a list of messages "
            "(in a CSV cell: its JSON text)"
        )
    messages = []
    for j, m in enumerate(raw):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(m, dict) or role_key not in m or (content_key not in m and not calls):
            raise DataError(f"{where}: message {j} of '{key}' needs '{role_key}' and '{content_key}' fields, got {m!r}")
        role = m[role_key]
        if fmt == "sharegpt":
            if not isinstance(role, str) or role not in SHAREGPT_ROLES:
                raise DataError(
                    f"{where}: message {j} has unknown sharegpt role {role!r} (key '{role_key}'); "
                    f"known roles: {', '.join(sorted(SHAREGPT_ROLES))}"
                )
            mapped = SHAREGPT_ROLES[role]
        else:
            known = sorted(set(CHAT_ROLES) | set(ds.roles_to_train))
            if not isinstance(role, str) or role not in known:
                raise DataError(
                    f"{where}: message {j} has unknown role {role!r} (key '{role_key}'); known roles: "
                    f"{', '.join(known)}; fix the row, or name the role in roles_to_train to train on it"
                )
            mapped = role
        what = f"message {j} (role {role!r})"
        msg = {k: v for k, v in m.items() if k not in (role_key, content_key) and v is not None}
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise DataError(f"{where}: {what}: 'tool_calls' must be a list of objects, got {_json_kind(calls)}")
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise DataError(f"{where}: {what}: 'reasoning_content' must be text, got {_json_kind(reasoning)}")
        content = m.get(content_key)
        # An assistant message that only calls tools has no content (OpenAI writes null).
        what = f"{what}, key '{content_key}'"
        if images is not None and (mapped in ds.roles_to_train if trained is None else trained):
            refuse_trained_media(content, where, what, mapped)
        text = "" if content is None and calls else message_content(content, where, what, images)
        messages.append({**msg, "role": mapped, "content": text})
    return messages


def _tools(row: dict, where: str) -> list | None:
    """A row's `tools` (function schemas for the template's tools block): a list of objects, or that list as a
    JSON string (as datasets store a column whose schemas differ row to row)."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: field 'tools' is a string but not JSON ({e.msg}); give a list of tools"
            ) from None
    if tools is None or (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return tools or None
    raise DataError(f"{where}: field 'tools' must be a list of tool objects, got {_json_kind(tools)}")


def _chat_example(
    tokenizer, messages, trained, tools, train_on_inputs: bool, where: str, fmt: str, template_kwargs: dict | None
) -> Example:
    if not tokenizer.chat_template:
        raise DataError(
            f"{where}: {fmt} data needs a tokenizer with a chat template; this tokenizer has none (set `chat_template`)"
        )
    try:
        spans = chat_spans(tokenizer, messages, trained, tools, template_kwargs)
    except TurnNotFound as e:
        raise DataError(
            f"{where}: {e}; check the row, or set `chat_template` to a template that renders every trained turn"
        ) from None
    except FieldNotRendered as e:
        raise DataError(f"{where}: {e}") from None
    except TemplateBudgetExceeded as e:  # the template's fault, not the row's: stops the data at once
        raise ConfigError(f"{where}: {e}") from None
    except Exception as e:  # jinja errors from templates that reject a role order, etc.
        raise DataError(f"{where}: the chat template cannot render this conversation ({e})") from None
    return _tokenize_spans(tokenizer, [(s, t or train_on_inputs) for s, t in spans])


def to_example(
    row: dict,
    fmt: str,
    tokenizer,
    ds: DatasetConfig,
    train_on_inputs: bool,
    where: str,
    roles_seen: set[str] | None = None,
    template_kwargs: dict | None = None,
    images=None,
) -> Example:
    """One row -> Example. `fmt` is a concrete format (not 'auto'). The chat roles of the row (as mapped) are
    added to `roles_seen` when it is given; `template_kwargs` go to the chat template (`chat_template_kwargs`);
    `images` (a vision-language model's `RowImages`) takes the row's image parts and expands their tokens."""
    ex = _to_example(row, fmt, tokenizer, ds, train_on_inputs, where, roles_seen, template_kwargs, images)
    return images.expand(ex, where) if images is not None else ex


def _to_example(row, fmt, tokenizer, ds, train_on_inputs, where, roles_seen, template_kwargs, images) -> Example:
    eos = tokenizer.eos_token or ""
    pair = (ds.field_prompt, ds.field_completion) if fmt == "prompt_completion" else ()
    row = decode_json_cells(row, json_fields(fmt, ds), pair)
    llava = images is not None and fmt in ("chat", "sharegpt")  # (`<image>` taken in message texts only)
    refuse_media(row, used_fields(fmt, ds, row), where, llava)
    if images is not None:
        images.column(row.get("images"), where)  # (LLaVA-style rows: an `images` column, `<image>` in the text)
    if fmt == "text":
        text = _field(row, ds.field_text, where, "text")
        if not isinstance(text, str):
            raise DataError(f"{where}: field '{ds.field_text}' must be a string, got {type(text).__name__}")
        return _tokenize_spans(tokenizer, [(text + eos, True)])
    if fmt == "alpaca":
        instruction = field_text(
            _field(row, ds.field_instruction, where, "alpaca"), where, f"alpaca field '{ds.field_instruction}'"
        )
        output = field_text(_field(row, ds.field_output, where, "alpaca"), where, f"alpaca field '{ds.field_output}'")
        inp = row.get(ds.field_input)
        inp = "" if inp is None else field_text(inp, where, f"alpaca field '{ds.field_input}'")
        if tokenizer.chat_template:
            user = f"{instruction}\n\n{inp}" if inp else instruction
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
            return _chat_example(tokenizer, messages, [False, True], None, train_on_inputs, where, fmt, template_kwargs)
        prompt = (ALPACA_PROMPT_INPUT if inp else ALPACA_PROMPT).format(instruction=instruction, input=inp)
        return _tokenize_spans(tokenizer, [(prompt, train_on_inputs), (output + eos, True)])
    if fmt == "prompt_completion":
        prompt = _field(row, ds.field_prompt, where, fmt)
        completion = _field(row, ds.field_completion, where, fmt)
        if isinstance(prompt, list) and isinstance(completion, list):  # conversational: lists of messages
            p = parse_messages(prompt, "chat", ds, where, ds.field_prompt, images, trained=False)
            c = parse_messages(completion, "chat", ds, where, ds.field_completion, images, trained=True)
            trained = [False] * len(p) + [True] * len(c)
            tools = _tools(row, where)
            return _chat_example(tokenizer, p + c, trained, tools, train_on_inputs, where, fmt, template_kwargs)
        if isinstance(prompt, list) or isinstance(completion, list):
            raise DataError(
                f"{where}: '{ds.field_prompt}' is {_json_kind(prompt)} and '{ds.field_completion}' is "
                f"{_json_kind(completion)}; give both as text or both as lists of messages"
            )
        prompt = field_text(prompt, where, f"field '{ds.field_prompt}'")
        completion = field_text(completion, where, f"field '{ds.field_completion}'")
        # As TRL: plain texts are concatenated without a chat template, and the completion ends with EOS.
        return _tokenize_spans(tokenizer, [(prompt, train_on_inputs), (completion + eos, True)])
    if fmt in ("chat", "sharegpt"):
        key = messages_key(fmt, ds, row)
        messages = parse_messages(_field(row, key, where, fmt), fmt, ds, where, key, images)
        if roles_seen is not None:
            roles_seen.update(m["role"] for m in messages)
        trained = [m["role"] in ds.roles_to_train for m in messages]
        tools = _tools(row, where)
        return _chat_example(tokenizer, messages, trained, tools, train_on_inputs, where, fmt, template_kwargs)
    raise DataError(f"{where}: unknown dataset type '{fmt}'; use text, alpaca, chat, sharegpt or prompt_completion")
