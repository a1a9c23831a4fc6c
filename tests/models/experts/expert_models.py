"""The tiny MoE blocks and models the grouped-experts tests share (plain builders with arguments, so not fixtures).

- `make_block(kind, dtype, seed, hidden, inter)`: one sparse-MoE block of transformers' (`qwen3_5_moe` or
  `qwen3_next`), E experts, top-K routing, weights ~ N(0, 0.4), eager experts loop.
- `tiny_config(experts_impl)`, `base_model(dtype, seed)`: a 2-layer Qwen3.5-MoE (GDN + attention), vocabulary VOCAB.
- `lora_model(dtype, r, routed, seed)`: that model under peft LoRA (q_proj and the experts' fused weights, B random),
  with hybridtune's grouped forward when `routed`.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from hybridtune.models import experts as X

E, K, H, INTER = 6, 3, 16, 8  # every matrix dimension a multiple of 8: bf16 grouped GEMMs take them
VOCAB = 64


def make_block(kind: str = "qwen3_5_moe", dtype=torch.float64, seed: int = 0, hidden: int = H, inter: int = INTER):
    cls, cfg_cls = {
        "qwen3_5_moe": (Qwen3_5MoeSparseMoeBlock, Qwen3_5MoeTextConfig),
        "qwen3_next": (Qwen3NextSparseMoeBlock, Qwen3NextConfig),
    }[kind]
    cfg = cfg_cls(
        hidden_size=hidden,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=inter,
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    block = cls(cfg).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.4)
    return block


def tiny_config(experts_impl: str = "eager") -> Qwen3_5MoeTextConfig:
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=E,
        num_experts_per_tok=3,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        attn_implementation="eager",
    )
    cfg._experts_implementation = experts_impl
    return cfg


def base_model(dtype=torch.float64, seed: int = 0) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(tiny_config())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:
                p.normal_(0, 0.3)  # experts are initialised empty by the class
    return model.to(dtype).eval()  # the same weights in every dtype


def lora_model(dtype=torch.float64, r: int = 4, routed: bool = False, seed: int = 0):
    model = base_model(dtype, seed)
    if routed:
        X.route_experts(model)
    torch.manual_seed(seed + 1)
    cfg = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=["q_proj"],
        target_parameters=["gate_up_proj", "down_proj"],
        init_lora_weights=False,  # B random too: the adapter changes the output
    )
    peft_model = get_peft_model(model, cfg)
    if routed:
        assert len(X.route_lora(peft_model)) == 2  # one outermost wrapper per layer
    return peft_model
