"""The batch contract: the keys of one packed micro-batch, built by `data.collator.PackedCollator` and read by
the patched layers, the compiled loop, the loss and the trainer. A leaf module: any layer may import it.

One bin of three documents (lengths 3, 2, 4), dynamic layout:

    input_ids     [ a0 a1 a2 | b0 b1 | c0 c1 c2 c3 ]           int64 [1, T]
    labels        [ -100 a1 a2 | -100 b1 | -100 c1 c2 c3 ]     int64 [1, T] (unshifted; -100 where untrained)
    position_ids  [ 0 1 2 | 0 1 | 0 1 2 3 ]                    int64 [1, T]
    cu_seq_lens_q [ 0 3 5 9 ]                                  int32 [N + 1] (== cu_seq_lens_k)
    + each registered mixer's metadata (mixers.registry.metadata), e.g. a chunked mixer's int32 [C, 2]

Names are transformers' own where they exist (the varlen attention kwargs), so an unpatched layer reads them too.
"""

from __future__ import annotations

from typing import TypedDict

import torch

INPUT_IDS = "input_ids"
LABELS = "labels"
POSITION_IDS = "position_ids"
CU_SEQ_LENS_Q = "cu_seq_lens_q"
CU_SEQ_LENS_K = "cu_seq_lens_k"
MAX_LENGTH_Q = "max_length_q"
MAX_LENGTH_K = "max_length_k"
NUM_LOSS_TOKENS = "num_loss_tokens"
NUM_TOKENS = "num_tokens"
# Preference packs (data/pairs.py's collator): each document's pair in the pack (0..P-1) and side (0 chosen,
# 1 rejected), int64 [N], -1 at a static layout's filler; the pack's pair count P (a python int).
PAIR_INDEX = "pair_index"
PAIR_SIDE = "pair_side"
NUM_PAIRS = "num_pairs"
# Packs with images (a vision-language model's; data/vision.py): the vision tower's input for every image of the
# pack in document order (float32 [patches, C*t*p*p], int64 [I, 3] patch grids) and each document's own 3-D M-RoPE
# positions laid end to end (int64 [3, T]; `position_ids` stays the text row). Absent from packs without images.
PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"
MROPE_POSITION_IDS = "mrope_position_ids"

# What the model's forward receives (with or without LABELS); the two counts stay with the trainer.
MODEL_KEYS = (
    INPUT_IDS,
    POSITION_IDS,
    LABELS,
    CU_SEQ_LENS_Q,
    CU_SEQ_LENS_K,
    MAX_LENGTH_Q,
    MAX_LENGTH_K,
    PIXEL_VALUES,
    IMAGE_GRID_THW,
)  # and each registered mixer's batch keys (`mixers.registry.model_keys`); MROPE_POSITION_IDS joins position_ids
# Python ints (no device sync to read them), and the tensors whose first dimension changes with the pack layout.
INT_KEYS = (MAX_LENGTH_Q, MAX_LENGTH_K)
DYNAMIC_DIM0_KEYS = (CU_SEQ_LENS_Q, CU_SEQ_LENS_K)  # and each mixer's (`mixers.registry.dynamic_keys`)


class Batch(TypedDict):
    """One packed micro-batch of batch size 1 (T tokens, N documents)."""

    input_ids: torch.Tensor  # int64 [1, T]
    labels: torch.Tensor  # int64 [1, T], -100 at masked tokens and the first token of every document
    position_ids: torch.Tensor  # int64 [1, T], restarting at 0 for every document
    cu_seq_lens_q: torch.Tensor  # int32 [N + 1], cumulative document lengths
    cu_seq_lens_k: torch.Tensor  # int32 [N + 1]
    max_length_q: int  # the longest document (the static layout's T)
    max_length_k: int
    # plus each registered mixer's metadata (`mixers.registry.metadata`), e.g. a chunked mixer's int32 [C, 2], and
    # in a pack with images pixel_values, image_grid_thw and mrope_position_ids (above)
    num_loss_tokens: int  # label positions that count in the loss
    num_tokens: int  # the bin's own documents' tokens (T without a static layout's filler)
