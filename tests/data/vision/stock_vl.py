"""Stock transformers' side of the vision-language inference tests: the checkpoint's own processor (transformers'
Qwen3VLProcessor over the saved tokenizer and image processor) called as a user calls it, and every input it returns
handed to `model.generate`, as its model card shows. Only two things stand in for what torchvision would do (it is
not installed here): the processor is built around the video processor's settings without the class check that needs
torchvision, and a video's pixel values come from data/video.py's FrameProcessor (the same settings, PIL's resize),
its text widened by the processor's own `replace_video_token`. `drop` leaves named inputs out: what a stock call that
makes hybridtune's old mistake (no mm_token_type_ids) answers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

PAD_IMAGE, PAD_VIDEO = "<|image_pad|>", "<|video_pad|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def processor(directory: Path):
    """The checkpoint's Qwen3VLProcessor: its tokenizer, image processor and video processor's settings."""
    from transformers import AutoTokenizer
    from transformers.models.auto.image_processing_auto import AutoImageProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tok = AutoTokenizer.from_pretrained(str(directory))
    image = AutoImageProcessor.from_pretrained(str(directory))
    settings = Path(directory) / "video_preprocessor_config.json"
    video = Qwen3VLVideoProcessor.from_json_file(str(settings)) if settings.is_file() else None

    class Processor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # (the video processor's class needs torchvision)
            return None

    return Processor(image_processor=image, tokenizer=tok, video_processor=video)


def prompt(proc, messages) -> str:
    """The chat template's text of `messages` (contents with IMAGE / VIDEO placeholders) with the generation prompt."""
    return proc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def image_inputs(proc, text: str, images: list) -> dict:
    """The processor's inputs for one prompt and its images (paths or PIL images)."""
    from PIL import Image

    pics = [Image.open(p).convert("RGB") if not isinstance(p, Image.Image) else p for p in images]
    kw = {"images": pics} if pics else {}
    return dict(proc(text=[text], return_tensors="pt", add_special_tokens=False, **kw))


def video_inputs(proc, text: str, folder: Path, fps: float) -> dict:
    """The processor's inputs for one prompt holding one video (a folder of frames at `fps`)."""
    from PIL import Image
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from hybridtune.data.video import FrameProcessor

    frames = [Image.open(p).convert("RGB") for p in sorted(folder.iterdir())]
    values, grid = FrameProcessor(proc.video_processor)(frames)
    meta = SimpleNamespace(frames_indices=list(range(len(frames))), fps=fps)
    holder = SimpleNamespace(
        video_processor=proc.video_processor,
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        video_token=PAD_VIDEO,
        _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a),
    )
    widened = Qwen3VLProcessor.replace_video_token(holder, {"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    enc = dict(proc(text=[text.replace(PAD_VIDEO, widened, 1)], return_tensors="pt", add_special_tokens=False))
    return {**enc, "pixel_values_videos": values, "video_grid_thw": grid}


def greedy(model, proc, inputs: dict, new: int, drop: tuple = ()) -> list[int]:
    """The greedy new tokens of `model.generate(**inputs)` (less the inputs named in `drop`), cut after the first
    end-of-turn id."""
    tok = proc.tokenizer
    given = {k: v for k, v in inputs.items() if k not in drop}
    with torch.no_grad():
        out = model.generate(**given, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    return ids[: ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids


def first_logits(model, inputs: dict, drop: tuple = ()) -> torch.Tensor:
    """The logits [vocab] of the first new token `model.generate(**inputs)` (less the inputs in `drop`) scores."""
    given = {k: v for k, v in inputs.items() if k not in drop}
    with torch.no_grad():
        out = model.generate(
            **given, max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    return out.logits[0][0].float()
