"""What the QLoRA tests share (plain builders, called with varying arguments): a tiny preset's QLoRA model as
training builds it (meta build, each weight read then quantised: runtime/quant.py; patched; LoRA), and its
dequantised reference (every NF4 weight replaced by its dequantised values as a plain fp32 tensor)."""

from __future__ import annotations

import torch

from hybridtune.config import ALL_LINEAR
from hybridtune.models.loading import LoadedModel
from hybridtune.models.meta import PresetReader, skeleton
from hybridtune.models.patching import patch_model
from hybridtune.models.presets import preset_config
from hybridtune.ops import nf4
from hybridtune.runtime.lora import apply_lora
from hybridtune.runtime.quant import materialize_quantized

EXPERTS = ["gate_up_proj", "down_proj"]


def qlora_model(name: str, dtype=torch.float32, seed: int = 0, experts: bool = False, layers=None):
    """(peft model, loaded) of preset `name` with an NF4 base and LoRA r=4 on all-linear (+ the experts' weights);
    `layers`: its layer types (default the preset's)."""
    config = preset_config(name, vocab_size=256)  # (a small vocabulary: the preset's layers, a fast head)
    if layers is not None:
        config.num_hidden_layers, config.layer_types = len(layers), list(layers)
    loaded = LoadedModel(skeleton(config), None, "preset", name, random_init=True)
    loaded.reader = lambda: PresetReader(config, seed)
    materialize_quantized(loaded, torch.device("cpu"), dtype)
    patch_model(loaded.model)
    torch.manual_seed(seed)
    model = apply_lora(loaded.model, 4, 8, 0.0, [ALL_LINEAR], EXPERTS if experts else ())
    with torch.no_grad():  # LoRA B starts at zero: give it values so that every gradient is exercised
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(hash(n) % 2**31))
    return model.train(), loaded


def dequantize_in_place(model) -> int:
    """Each NF4 weight of `model` replaced by a plain frozen fp32 parameter of its dequantised values (the reference
    a QLoRA step must equal); returns how many."""
    n = 0
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None and nf4.is_nf4(p):
                module._parameters[attr] = torch.nn.Parameter(nf4.dequantize(p, torch.float32), requires_grad=False)
                n += 1
    assert not any(nf4.is_nf4(p) for p in model.parameters())
    return n


def nf4_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if nf4.is_nf4(p)}
