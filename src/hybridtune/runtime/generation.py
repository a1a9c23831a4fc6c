"""Generation on the live weights, below the trainer, so that eval samples, the `generate`/`chat`/`eval` commands and
an on-policy objective share one path: transformers' own `generate` with the model's recurrent and key/value cache
(the patched mixers take the upstream forward whenever a cache is given).

`complete` renders nothing: it takes texts, pads them on the left, and returns each row's new token ids `[n]` cut
after the first end-of-turn id, with its finish reason; `generate` renders prompts first; `greedy` decodes one
prompt of token ids. A vision-language model's prompts may hold image parts: each renders as the processor's
placeholder (as in training), `complete` widens it to the image's visual tokens and passes every input the
checkpoint's processor returns (data.vision.Vision.model_inputs: the pixels, grids and mm_token_type_ids, by which
the model gives visual tokens their M-RoPE positions as in training), checked against what get_rope_index reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from hybridtune.data.images import image_source, is_image_part, load_image, part_reference
from hybridtune.errors import DataError, ModelError
from hybridtune.runtime.vision import check_rope_inputs


@dataclass
class Completion:
    prompt: str
    completion: str
    new_tokens: int
    finish_reason: str  # "stop" (end of turn) or "length" (max_new_tokens)


@dataclass
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None

    def kwargs(self) -> dict:
        """generate()'s decoding arguments; every one is given, so a model's own sampling defaults (a released
        checkpoint's generation_config often samples) never turn greedy decoding into sampling."""
        if self.temperature <= 0:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or None}


def eos_ids(model, tokenizer) -> list[int]:
    """The ids that end a turn: the generation config's end-of-sequence ids and the tokenizer's."""
    ids: list[int] = []
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def render(tokenizer, conversation: list[dict] | str, chat: bool, template_kwargs: dict | None = None) -> str:
    """The text the model continues: a conversation through the chat template with the assistant's generation
    prompt (`template_kwargs`: the template's variables, e.g. enable_thinking), or plain text as it is."""
    if not chat:
        return conversation if isinstance(conversation, str) else "\n".join(m["content"] for m in conversation)
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("the model's tokenizer has no chat template; pass --no_chat_template to give plain text")
    from jinja2 import TemplateError  # why here: only a chat prompt needs it

    from hybridtune.data.chat import render as render_chat  # within the template work budget, as training renders
    from hybridtune.data.template_budget import TemplateBudgetExceeded

    try:
        return render_chat(tokenizer, conversation, generation_prompt=True, template_kwargs=template_kwargs)
    except TemplateBudgetExceeded as e:
        raise ModelError(str(e)) from None
    except TemplateError as e:  # a template's raise_exception (a role order it refuses) or its own bug
        raise ModelError(
            f"the chat template cannot render the prompt ({e}); give a conversation it accepts, or --no_chat_template"
        ) from None


def not_vision(name: str, given: str = "--image and the prompts' image parts") -> ModelError:
    """A text model given images or videos; `given`: what put them there (the flag, the prompts file's row)."""
    return ModelError(
        f"model '{name}' is not a vision-language model (its config has no vision_config and image_token_id), so "
        f"it takes no image or video; drop {given}, or give a vision-language checkpoint"
    )


def with_image_text(prompt, vision, where: str, name: str = "MODEL") -> tuple:
    """(`prompt` with each message's content as text, the sources of its images in order): a content list's text
    parts joined, an image part ({"type": "image", "image": PATH} or "image_url") as `vision`'s placeholder. A
    ModelError when there is an image and no `vision` (not a vision-language model)."""
    if isinstance(prompt, str):
        return prompt, []
    sources: list[str] = []
    messages = []
    for j, m in enumerate(prompt):
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for k, part in enumerate(content):
                what = f"message {j}, content part {k}"
                if is_image_part(part):
                    if vision is None:
                        raise not_vision(name)
                    sources.append(image_source(part_reference(part, where, what), None, where, what))
                    texts.append(vision.placeholder)
                else:
                    texts.append(part.get("text", ""))
            content = "".join(texts)
        messages.append({**m, "content": content})
    return messages, sources


def expand_images(text: str, images: list, vision, where: str) -> str:
    """`text` with the image token of each placeholder repeated once per visual token of its image (`images`: the
    images' patch grids, in order), as the checkpoint's processor writes a prompt."""
    pieces = text.split(vision.image_token)
    if len(pieces) - 1 != len(images):
        raise DataError(
            f"{where}: the rendered prompt holds {len(pieces) - 1} image token(s) {vision.image_token!r} for "
            f"{len(images)} image(s); remove image tokens written as text"
        )
    out = [pieces[0]]
    for grid, tail in zip(images, pieces[1:]):
        out += [vision.image_token * vision.tokens_of(grid), tail]
    return "".join(out)


def _image_inputs(texts: list[str], images: list[list[str]], vision, first: int) -> tuple[list[str], dict | None]:
    """The texts widened to their visual tokens and generate()'s pixel_values / image_grid_thw for their images
    (None without images)."""
    if not any(images):
        return texts, None
    pics = [load_image(s, f"prompt {first + i + 1}", f"image {k + 1}") for i, row in enumerate(images)
            for k, s in enumerate(row)]  # fmt: skip
    values, grid = vision.process(pics)
    grids, out, at = grid.tolist(), [], 0
    for i, (text, row) in enumerate(zip(texts, images)):
        out.append(expand_images(text, grids[at : at + len(row)], vision, f"prompt {first + i + 1}"))
        at += len(row)
    return out, {"pixel_values": values, "image_grid_thw": grid}


def model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def complete(
    model,
    tokenizer,
    texts: list[str],
    sampling: Sampling,
    chat: bool = True,
    batch_size: int = 8,
    streamer=None,
    images: list[list[str]] | None = None,
    vision=None,
    videos: dict | None = None,
) -> list[tuple[list[int], str]]:
    """The new tokens of each rendered text (cut after the first end-of-turn id, which they keep) and its finish
    reason. `chat`: the texts were rendered by the chat template, which writes its own special tokens. `images`:
    each text's image sources, one per placeholder in it, read through `vision` (data.vision.Vision). `videos`: the
    processed videos (pixel_values_videos, video_grid_thw) of the texts, their video tokens widened already
    (infer/video_prompts.py)."""
    eos = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # the new tokens of every row start at the same column
    out: list[tuple[list[int], str]] = []
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    try:
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            rows = (images or [[]] * len(texts))[start : start + batch_size]
            chunk, pixels = _image_inputs(chunk, rows, vision, start)
            enc = dict(tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=not chat))
            if pixels or videos:  # as the processor returns them (M-RoPE as trained), never pixels alone
                enc = vision.model_inputs(enc, pixels, videos)
                check_rope_inputs(model, enc)
            enc = {k: v.to(model_device(model)) for k, v in enc.items()}
            gen = model.generate(
                **enc,
                max_new_tokens=sampling.max_new_tokens,
                eos_token_id=eos or None,
                pad_token_id=pad,
                streamer=streamer,
                **sampling.kwargs(),
            )
            for row in gen[:, enc["input_ids"].shape[1] :].tolist():
                stop = next((i for i, t in enumerate(row) if t in eos), None)
                out.append((row, "length") if stop is None else (row[: stop + 1], "stop"))
    finally:
        tokenizer.padding_side = side
    return out


def generate(
    model,
    tokenizer,
    prompts: list,
    sampling: Sampling,
    chat: bool = True,
    batch_size: int = 8,
    template_kwargs: dict | None = None,
    vision=None,
    name: str = "MODEL",
) -> list[Completion]:
    """Completions of `prompts` (each a string, or a conversation: a list of {role, content}, content text or a
    list of text and image parts; images need `vision`, the model's, else a ModelError naming model `name`)."""
    split = [with_image_text(p, vision, f"prompt {i}", name) for i, p in enumerate(prompts, 1)]
    texts = [render(tokenizer, p, chat, template_kwargs) for p, _ in split]
    done = complete(model, tokenizer, texts, sampling, chat, batch_size, images=[s for _, s in split], vision=vision)
    return [
        Completion(
            p if isinstance(p, str) else json.dumps(p), tokenizer.decode(ids, skip_special_tokens=True), len(ids), why
        )
        for p, (ids, why) in zip(prompts, done)
    ]


@torch.no_grad()
def greedy(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    stop: list[int],
    pad_token_id: int,
    device: torch.device,
) -> list[int]:
    """The tokens greedy decoding adds to `prompt` (transformers `generate`, with the model's cache)."""
    ids = torch.tensor([prompt], device=device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=stop,
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()
