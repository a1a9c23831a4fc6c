"""Time to the first step (the compile) of the `loop` strategy on the CPU, static vs dynamic pack layout.

    python benchmarks/compile_time.py LAYERS static|dynamic [regional] [BACKEND] [torch-schema]

The 2B topology (3 GDN layers, then 1 attention layer, repeated) at the tiny preset's width, LoRA r=16 on the ten
default targets, gradient checkpointing, fused loss, backend `aot_eager` (dynamo + AOT autograd, no inductor: what
is traced, not what is generated; BACKEND `inductor` generates CPU code too). `regional`: each distinct decoder
layer traced once (`compile_loop(regional=True)`). Three steps over three pack layouts; prints each step's time
and loss, then AOT autograd's and dynamo's compile phases. `torch-schema`: torch's own per-call mutation check on
each region (every layer's body re-traced), not hybridtune's memo of it (`compiler/region_schema.py`).
"""

import sys
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from hybridtune.bench.worker import compile_phases
from hybridtune.compiler import region_schema
from hybridtune.compiler.loop import compile_loop
from hybridtune.config import DEFAULT_LORA_TARGETS
from hybridtune.data.collator import PackedCollator, StaticLayout
from hybridtune.data.packing import Example
from hybridtune.models.patching import patch_model
from hybridtune.models.presets import preset_config
from hybridtune.runtime.lora import apply_lora
from hybridtune.train.objectives.sft import sft_loss

n_layers, layout = int(sys.argv[1]), sys.argv[2]
regional = len(sys.argv) > 3 and sys.argv[3] == "regional"
backend = sys.argv[4] if len(sys.argv) > 4 else "aot_eager"
if "torch-schema" in sys.argv[5:]:
    region_schema.memoize = lambda: "region schemas: torch's own check (benchmark option)"
cfg = preset_config("tiny-qwen3_5", vocab_size=256)
cfg.num_hidden_layers = n_layers
cfg.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)
patch_model(model)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model = apply_lora(model, 16, 32, 0.0, list(DEFAULT_LORA_TARGETS))
model.train()
LAYOUTS = [[100, 28, 70], [64, 11, 100, 9], [5, 90, 33, 60]]
collate = PackedCollator(layout=StaticLayout.fit(LAYOUTS, max_filler=1.0)) if layout == "static" else PackedCollator()
compile_loop(model, backend=backend, static_shapes=layout == "static", regional=regional)
for i, lens in enumerate(LAYOUTS):
    gen = torch.Generator().manual_seed(i)
    batch = collate([Example(torch.randint(1, 256, (n,), generator=gen).tolist(), [1] * n) for n in lens])
    t = time.perf_counter()
    loss = sft_loss(model, batch, batch["num_loss_tokens"], fused=True)
    loss.backward()
    print(
        f"{layout} layers={n_layers} regional={regional} {backend} step {i} {time.perf_counter() - t:.1f}s loss {loss.item():.5f}",
        flush=True,
    )
print("graphs", counters["stats"]["unique_graphs"], "breaks", dict(counters["graph_break"]))
phases = compile_phases(least=0.0)
for name in ("_compile.compile_inner", "bytecode_tracing", "aot_collect_metadata", "aot_trace_joint_graph"):
    print(f"{name} {phases.get(name, 0.0):.1f}s")
