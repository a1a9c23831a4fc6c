"""Videos in `generate` and `chat` prompts: `--video PATH` (a folder of frames, or frame paths joined by commas) with
`--fps`, and a prompts file's video parts (`{"type": "video", "video": FOLDER or [frames], "fps": N}`, relative to the
file), read as training data's videos are (data/video.py: frames checked, the checkpoint's video processor).

A video part renders as the chat template writes one (vision start, the video token, vision end); after rendering,
each video token becomes the processor's text for the video (Qwen3VLProcessor's `replace_video_token`: per temporal
group `<t seconds>`, vision start, h*w/merge^2 video tokens, vision end), and generate() gets `pixel_values_videos` /
`video_grid_thw` with the rest of the processor's inputs (`Vision.model_inputs`). A prompt with a video is completed
alone (its inputs go with its generate call).
"""

from __future__ import annotations

from pathlib import Path

from hybridtune.data.video import DEFAULT_FPS, is_video_part, parse_key, timestamps, video_key
from hybridtune.errors import ConfigError


def video_arg(value: str, fps: float, where: str) -> dict:
    """`--video VALUE` as a video part (resolved from the working directory, checked now): a folder of frames, or
    frame paths joined by commas; `--fps` within data/video.py's FPS_RANGE (one frame an hour to 240 a second), else
    one line before the model loads."""
    if not value.strip():
        raise ConfigError(f"{where}: give a folder of frames or frame paths joined by commas")
    ref = value if "," not in value else [v.strip() for v in value.split(",") if v.strip()]
    key = video_key({"type": "video", "video": ref, "fps": fps}, None, where, "the video")  # (typed: not confined)
    return {"type": "video", "video": key}


def resolved(part: dict, where: str, what: str, base: Path | None) -> dict:
    """A prompts file's video part with its frames resolved (relative to the file) and checked: {"type": "video",
    "video": its `video_key`}. Every part is checked, one that holds a key already too: passed through, a written
    `"video:{...}"` skipped the fps range (1e-300 generated with a 300-digit time per frame group) and the frame
    count, and a malformed one was a traceback after the model loaded; as a path it is a folder that does not exist."""
    return {"type": "video", "video": video_key(part, base, where, what)}


def has_videos(prompts: list) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(is_video_part(c) for c in m["content"])
        for p in prompts
        if isinstance(p, list)
        for m in p
    )


def as_placeholders(prompt, vision, where: str) -> tuple:
    """(`prompt` with each video part as a text part holding the video placeholder, its videos' keys in order)."""
    if isinstance(prompt, str):
        return prompt, []
    keys, out = [], []
    for j, m in enumerate(prompt):
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for k, c in enumerate(content):
                if is_video_part(c):
                    keys.append(c["video"])
                    c = {"type": "text", "text": vision.video_placeholder(where, f"message {j}, content part {k}")}
                parts.append(c)
            content = parts
        out.append({**m, "content": content})
    return out, keys


def expand(text: str, keys: list[str], vision, where: str) -> tuple[str, dict]:
    """`text` with each video token widened as the processor does, and generate()'s video inputs."""
    import torch

    pieces = text.split(vision.video_token)
    if len(pieces) - 1 != len(keys):
        raise ConfigError(
            f"{where}: the rendered prompt holds {len(pieces) - 1} video token(s) {vision.video_token!r} for "
            f"{len(keys)} video(s); remove video tokens written as text"
        )
    out, values, grids = [pieces[0]], [], []
    for key, tail in zip(keys, pieces[1:]):
        vals, (t, h, w) = vision.video(key, where, "video")
        frames, fps = parse_key(key)
        n = h * w // (vision.merge * vision.merge)
        start, end = vision.tokenizer.convert_ids_to_tokens([vision.start_id, vision.end_id])
        groups = timestamps(len(frames), fps, vision.video_processor.temporal)[:t]
        out += ["".join(f"<{s:.1f} seconds>{start}{vision.video_token * n}{end}" for s in groups), tail]
        values.append(vals)
        grids.append([t, h, w])
    return "".join(out), {"pixel_values_videos": torch.cat(values), "video_grid_thw": torch.tensor(grids)}


def complete_videos(model, tokenizer, texts, keys, sampling, chat, batch_size, images, vision, streamer=None):
    """`runtime.generation.complete` of rendered `texts`, each prompt with videos (`keys[i]`) alone."""
    from hybridtune.runtime.generation import complete

    done: list = [None] * len(texts)
    plain = [i for i, k in enumerate(keys) if not k]
    if plain:
        out = complete(model, tokenizer, [texts[i] for i in plain], sampling, chat, batch_size,
                       images=[images[i] for i in plain], vision=vision, streamer=streamer)  # fmt: skip
        for i, d in zip(plain, out):
            done[i] = d
    for i, k in enumerate(keys):
        if k:
            text, inputs = expand(texts[i], k, vision, f"prompt {i + 1}")
            (done[i],) = complete(model, tokenizer, [text], sampling, chat, 1, images=[images[i]], vision=vision,
                                  streamer=streamer, videos=inputs)  # fmt: skip
    return done


def generate(model, tokenizer, prompts, sampling, chat, batch_size, template_kwargs, vision, name):
    """`runtime.generation.generate` for prompts of which some hold videos."""
    import json

    from hybridtune.runtime.generation import Completion, render, with_image_text

    split = [as_placeholders(p, vision, f"prompt {i}") for i, p in enumerate(prompts, 1)]
    rows = [with_image_text(p, vision, f"prompt {i}", name) for i, (p, _) in enumerate(split, 1)]
    texts = [render(tokenizer, p, chat, template_kwargs) for p, _ in rows]
    keys, images = [k for _, k in split], [s for _, s in rows]
    done = complete_videos(model, tokenizer, texts, keys, sampling, chat, batch_size, images, vision)
    return [
        Completion(
            p if isinstance(p, str) else json.dumps(p), tokenizer.decode(ids, skip_special_tokens=True), len(ids), why
        )
        for p, (ids, why) in zip(prompts, done)
    ]


__all__ = ["DEFAULT_FPS", "as_placeholders", "complete_videos", "generate", "has_videos", "resolved", "video_arg"]
