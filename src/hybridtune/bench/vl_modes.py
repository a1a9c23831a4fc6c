"""The vision-language bench's batches and the hf modes' engine (`hybridtune bench --vision`, data: bench/vl_data.py;
docs/CONFIG.md, "Benchmarking vision-language training"). One pack's documents per step, for every mode:
  ht-*     hybridtune's own vision packing (`PackedCollator(vision=...)`: one row, per-document M-RoPE).
  hf-eager the documents as one right-padded batch [documents, longest] with attention_mask and mm_token_type_ids,
           transformers' own M-RoPE and loss (labels), as users run transformers + peft.
  hf-pf    transformers' padding-free path: `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`'s row plus
           pixel_values / image_grid_thw; transformers takes its 1-D position_ids for every M-RoPE row (and its
           torch linear-attention fallback ignores cu_seq_lens: on the CPU the state crosses documents).
Tokens per step: the documents' own, text + visual. FLOPs: the text model's (models/flops.py) plus the frozen tower's
forward (`tower_flops`).
"""

from __future__ import annotations

import torch

from hybridtune.batch import NUM_LOSS_TOKENS, NUM_TOKENS
from hybridtune.bench import vl_data
from hybridtune.data.collator import PackedCollator
from hybridtune.runtime.compose import Composed

IGNORE = -100
VISION_FLOPS = "vision_flops"


class HFVisionLoss(torch.nn.Module):
    """An hf mode's engine: the model's own forward with labels on `batch["hf"]` (transformers' mean loss)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.objective = TokenCount()

    def forward(self, batch: dict, num_items: int | None = None) -> torch.Tensor:
        return self.model(**batch["hf"]).loss


class TokenCount:
    def window_items(self, batches: list[dict]) -> int:
        return sum(b[NUM_LOSS_TOKENS] for b in batches)


def hf_engine(c: Composed) -> Composed:
    """The hf mode's `Composed` with `HFVisionLoss` as its engine."""
    engine = HFVisionLoss(c.model)
    return Composed(c.run, engine, engine, c.device, c.bf16, cuda_graphs=False)


def doc_layouts(spec: dict) -> list[list[int]]:
    return [[len(d["ids"]) for d in p] for p in vl_data.load_packs(spec["vision_dir"])]


def tower_flops(vcfg, grids: list[tuple[int, int, int]]) -> float:
    """The vision tower's forward FLOPs over images of patch grids `grids` (t, h, w): per patch the patch embedding
    and every block's weights (qkv, proj, the MLP), per frame group its attention (QK^T and AV), per merged token
    the merger's two layers (2 FLOPs a multiply-add)."""
    h, inter, depth = vcfg.hidden_size, vcfg.intermediate_size, vcfg.depth
    m2 = vcfg.spatial_merge_size**2
    patch_in = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    per_patch = 2.0 * (patch_in * h + depth * (4 * h * h + 2 * h * inter))
    merged = 2.0 * (m2 * h * m2 * h + m2 * h * vcfg.out_hidden_size)
    total = 0.0
    for t, gh, gw in grids:
        n = gh * gw  # patches of one frame group (attention is within a group)
        total += t * n * per_patch + t * depth * 4.0 * n * n * h + t * n / m2 * merged
    return total


def batches(spec: dict, mode, source, tokenizer, layout, vcfg) -> list[dict]:
    """The packs as this mode's batches (on the host), each with its documents' lengths and its tower FLOPs."""
    from hybridtune.runtime.vision import vision_for

    vision = vision_for(source, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    for pack in vl_data.load_packs(spec["vision_dir"]):
        docs = vl_data.examples(pack)
        refs = [im for d in docs for im in d.images]
        if mode.patch:
            b = PackedCollator(layout=layout, pad_token_id=pad, vision=vision)(docs)
        else:
            b = _hf_batch(docs, refs, vision, pad, flatten=mode.flatten)
        b["doc_lens"] = [len(d) for d in docs]
        b[VISION_FLOPS] = tower_flops(vcfg, [r.grid for r in refs])
        out.append(b)
    return out


def _hf_batch(docs, refs, vision, pad: int, flatten: bool) -> dict:
    pixels, grid = vision.pixels(refs)
    labels = [[t if m else IGNORE for t, m in zip(d.input_ids, d.loss_mask)] for d in docs]
    if flatten:
        from transformers import DataCollatorWithFlattening

        collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
        hf = dict(collate([{"input_ids": d.input_ids, "labels": lab} for d, lab in zip(docs, labels)]))
    else:
        n = max(len(d) for d in docs)
        hf = {
            "input_ids": torch.tensor([d.input_ids + [pad] * (n - len(d)) for d in docs]),
            "attention_mask": torch.tensor([[1] * len(d) + [0] * (n - len(d)) for d in docs]),
            "labels": torch.tensor([lab + [IGNORE] * (n - len(lab)) for lab in labels]),
            # what the processor returns beside input_ids: 1 at image tokens (transformers' M-RoPE needs it)
            "mm_token_type_ids": torch.tensor(
                [[int(t == vision.image_token_id) for t in d.input_ids] + [0] * (n - len(d)) for d in docs]
            ),
        }
    hf.update(pixel_values=pixels, image_grid_thw=grid)
    trained = sum(1 for d in docs for m in d.loss_mask[1:] if m)  # (a document's first token is never a target)
    return {
        "hf": hf,
        NUM_TOKENS: sum(len(d) for d in docs),
        NUM_LOSS_TOKENS: trained,
        "padded_tokens": int(hf["input_ids"].numel()),
    }


def to_device(batch: dict, device: torch.device) -> dict:
    """A vision batch's tensors (an hf batch's nested ones too) on `device`."""
    from hybridtune.runtime.stream import to_device as move

    out = move(batch, device)
    if "hf" in out:
        out["hf"] = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in out["hf"].items()}
    return out
