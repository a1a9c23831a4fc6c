"""Tiny saved checkpoints of each kind hybridtune starts from, and a Hugging Face hub cache laid out around one, for
tests (no downloads). Import as `from checkpoints import make_checkpoint, KINDS, hub_cache` (tests/ is on the path;
or `from tests.checkpoints import ...`).

Kinds (config.json `architectures[0]` in brackets):
- `qwen3_5_text`   Qwen3.5 text-only [Qwen3_5ForCausalLM]; tied embeddings; one model.safetensors
- `qwen3_5_vl`     Qwen3.5 vision-language [Qwen3_5ForConditionalGeneration]; tiny vision tower; tied embeddings;
                   sharded (model.safetensors.index.json) with `mtp.*` tensors in its last shard, as released
                   checkpoints carry them (transformers drops them on load); a preprocessor_config.json
- `qwen3_5_moe_vl` Qwen3.5-MoE vision-language [Qwen3_5MoeForConditionalGeneration]; 4 experts (saved per
                   expert, as transformers writes them); untied; sharded, `mtp.*` tensors; preprocessor_config.json
- `qwen3_next`     Qwen3-Next [Qwen3NextForCausalLM]; 4 experts; untied; one file with `mtp.*` tensors

All: hidden 64, 4 layers (3 GDN + 1 attention), vocabulary = the bundled tokenizer's (463), saved beside them
with its ChatML chat template (or the `chat_template` given), pad/eos ids from it, seeded random weights
(`seed`), saved in `dtype` (config.json's `dtype` says it). Each builds and saves in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.utils import logging as tf_logging

KINDS = ("qwen3_5_text", "qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_next")
ARCHITECTURES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_vl": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
}
VL_KINDS = ("qwen3_5_vl", "qwen3_5_moe_vl")
MOE_KINDS = ("qwen3_5_moe_vl", "qwen3_next")
MTP_KINDS = ("qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_next")  # the kinds whose files carry `mtp.*` by default
MTP_PREFIX = "mtp."

HIDDEN = 64
_LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
_TEXT = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=4,
    layer_types=_LAYER_TYPES,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # grouped values (HV = 2H), as in the real shapes
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    initializer_range=0.02,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=HIDDEN,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=1,
)


def _tokenizer():
    from hybridtune.models.tokenizer_files import bundled_tokenizer

    return bundled_tokenizer()


def build_config(kind: str, vocab_size: int | None = None):
    """The transformers config of a tiny checkpoint of `kind` (vocabulary sized to the bundled tokenizer)."""
    import transformers as tf

    tok = _tokenizer()
    vocab = vocab_size or len(tok)
    ids = dict(vocab_size=vocab, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    if kind == "qwen3_5_text":
        cfg = tf.Qwen3_5TextConfig(**_TEXT, **ids, tie_word_embeddings=True)
    elif kind == "qwen3_5_vl":
        cfg = tf.Qwen3_5Config(text_config={**_TEXT, **ids}, vision_config=_VISION, tie_word_embeddings=True)
    elif kind == "qwen3_5_moe_vl":
        text = {k: v for k, v in _TEXT.items() if k != "intermediate_size"}
        cfg = tf.Qwen3_5MoeConfig(text_config={**text, **_MOE, **ids}, vision_config=_VISION, tie_word_embeddings=False)
    elif kind == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**_TEXT, **_MOE, **ids, decoder_sparse_step=1, tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown kind {kind!r}; kinds: {KINDS}")
    cfg.architectures = [ARCHITECTURES[kind]]
    return cfg


def build_model(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A tiny model of `kind` in its original class, seeded random weights, parameters in `dtype`."""
    import transformers as tf

    cfg = build_config(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(tf, ARCHITECTURES[kind])(cfg)
    model.to(dtype)
    model.config.dtype = dtype
    return model.eval()


def _mtp_tensors(kind: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Multi-token-prediction weights shaped like the released ones (one extra decoder layer with full attention,
    an fc fusing embedding and hidden state, its norms): `mtp.fc.weight`, `mtp.layers.0.*`, `mtp.norm.weight`..."""
    t = _TEXT
    h, hd = t["hidden_size"], t["head_dim"]
    nh, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nh * hd, h),  # query and its output gate
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * hd, h),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * hd, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, nh * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
    }
    if kind in MOE_KINDS:
        m, s = _MOE["moe_intermediate_size"], _MOE["shared_expert_intermediate_size"]
        for e in range(_MOE["num_experts"]):
            p = f"mtp.layers.0.mlp.experts.{e}."
            shapes |= {p + "gate_proj.weight": (m, h), p + "up_proj.weight": (m, h), p + "down_proj.weight": (h, m)}
        shapes |= {
            "mtp.layers.0.mlp.gate.weight": (_MOE["num_experts"], h),
            "mtp.layers.0.mlp.shared_expert.gate_proj.weight": (s, h),
            "mtp.layers.0.mlp.shared_expert.up_proj.weight": (s, h),
            "mtp.layers.0.mlp.shared_expert.down_proj.weight": (h, s),
            "mtp.layers.0.mlp.shared_expert_gate.weight": (1, h),
        }
    else:
        i = t["intermediate_size"]
        shapes |= {
            "mtp.layers.0.mlp.gate_proj.weight": (i, h),
            "mtp.layers.0.mlp.up_proj.weight": (i, h),
            "mtp.layers.0.mlp.down_proj.weight": (h, i),
        }
    g = torch.Generator().manual_seed(seed + 1)
    return {k: (torch.randn(shape, generator=g) * 0.02).to(dtype) for k, shape in shapes.items()}


def add_tensors(ckpt_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write extra tensors into a saved checkpoint: into its last shard (and the index's weight_map) when sharded,
    else into model.safetensors."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        target = sorted(set(meta["weight_map"].values()))[-1]
        meta["weight_map"].update({k: target for k in tensors})
        meta["weight_map"] = dict(sorted(meta["weight_map"].items()))
        extra = sum(t.numel() * t.element_size() for t in tensors.values())
        meta.setdefault("metadata", {})["total_size"] = meta.get("metadata", {}).get("total_size", 0) + extra
        index.write_text(json.dumps(meta, indent=2) + "\n")
    else:
        target = "model.safetensors"
    path = ckpt_dir / target
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {"format": "pt"}
    merged = load_file(str(path)) | {k: v.contiguous() for k, v in tensors.items()}
    save_file(merged, str(path), metadata=metadata)


def _preprocessor_config() -> dict:
    v = _VISION
    return {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": v["patch_size"],
        "merge_size": v["spatial_merge_size"],
        "temporal_patch_size": v["temporal_patch_size"],
        "size": {"shortest_edge": 64, "longest_edge": 4096},
    }


def make_checkpoint(
    tmp_path: Path | str,
    kind: str,
    dtype: torch.dtype = torch.float32,
    *,
    name: str | None = None,
    seed: int = 0,
    mtp: bool | None = None,
    sharded: bool | None = None,
    chat_template: str | None = None,
) -> Path:
    """Save a tiny checkpoint of `kind` under `tmp_path/name` (default: `<kind>-<dtype>`) and return its directory.

    `mtp` (default: kind in MTP_KINDS) adds `mtp.*` tensors to the saved files; `sharded` (default: kind in VL_KINDS)
    saves several shards with model.safetensors.index.json; `chat_template` (jinja text) replaces the bundled
    tokenizer's ChatML template."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; kinds: {KINDS}")
    out = Path(tmp_path) / (name or f"{kind}-{str(dtype).removeprefix('torch.')}")
    model = build_model(kind, dtype, seed)
    sharded = kind in VL_KINDS if sharded is None else sharded
    # A shard limit of about half the model's bytes: two or three shards (transformers writes the index).
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    bars = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()  # no "Writing model shards" bars in the tests' captured stderr
    try:
        model.save_pretrained(str(out), max_shard_size=size // 2 + 1 if sharded else "1GB")
    finally:
        if bars:
            tf_logging.enable_progress_bar()
    if mtp if mtp is not None else kind in MTP_KINDS:
        add_tensors(out, _mtp_tensors(kind, dtype, seed))
    tok = _tokenizer()
    tok.save_pretrained(str(out))
    if chat_template is not None:
        for stale in ("chat_template.jinja", "chat_template.json"):
            (out / stale).unlink(missing_ok=True)
        (out / "chat_template.jinja").write_text(chat_template)
    if kind in VL_KINDS:
        (out / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(), indent=2) + "\n")
    return out


def safetensors_files(ckpt_dir: Path | str) -> list[Path]:
    """The checkpoint's weight files (the index's shards, or model.safetensors)."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        return [ckpt_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [ckpt_dir / "model.safetensors"]


def read_tensors(ckpt_dir: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor saved in a checkpoint directory, by key (all shards)."""
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(ckpt_dir):
        out |= load_file(str(f))
    return out


def fake_sha(text: str) -> str:
    """A 40-hex commit-like id derived from `text`."""
    return hashlib.sha1(text.encode()).hexdigest()


def hub_cache(
    tmp_path: Path | str,
    repo_id: str,
    ckpt_dir: Path | str,
    revision_sha: str | None = None,
    *,
    ref: str | None = "main",
    hf_home: Path | str | None = None,
    copies: bool = False,
) -> Path:
    """Lay `ckpt_dir` out as the hub cache holds a downloaded model and return HF_HOME (the cache is HF_HOME/hub):

        HF_HOME/hub/models--<org>--<name>/blobs/<sha256 of each file>
                                         /snapshots/<revision_sha>/<file>  (relative links into blobs, or copies)
                                         /refs/<ref>                       (holds revision_sha; ref None: no ref)

    Several calls with the same `hf_home` add repos or revisions to one cache. Use with HF_HUB_OFFLINE=1 and
    HF_HOME (or HF_HUB_CACHE=HF_HOME/hub) set, e.g. `monkeypatch.setenv("HF_HOME", str(home))`."""
    ckpt_dir = Path(ckpt_dir)
    home = Path(hf_home) if hf_home is not None else Path(tmp_path) / "hf_home"
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    revision_sha = revision_sha or fake_sha(f"{repo_id}:{ckpt_dir.name}")
    snap = repo / "snapshots" / revision_sha
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for src in sorted(p for p in ckpt_dir.rglob("*") if p.is_file()):
        rel = src.relative_to(ckpt_dir)
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(src, blob)
        dst = snap / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        if copies:
            shutil.copyfile(blob, dst)
        else:
            os.symlink(os.path.relpath(blob, dst.parent), dst)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(revision_sha)
    return home
