"""What the compiled-loop tests share (plain builders, called with varying arguments inside parametrized tests and
inside other helpers, so not fixtures): a packed batch, one training step, the tiny models they train,
a recording backend and the comparison of two steps.

- `packed_batch(lens, device, seed)`: documents of `lens` tokens packed in one row [1, sum(lens)] with varlen
  metadata; random ids below 256, labels = ids.
- `train_step(model, batch)`: (loss, {name: grad}) of one forward and backward; gradients cleared after.
- `loop_model(cfg, device, lora, ckpt)`: the model of `cfg` (MoE experts as batched_mm), patched, in train mode;
  LoRA and checkpointing as asked; on CUDA the FLA layouts self-tested first.
- `deep_model(device, lora, ckpt, name, depth)`: `loop_model` of a `depth`-layer tiny preset (every fourth layer
  attention, the rest GDN).
- `recording_backend(backend, graphs, regional)`: `backend`, appending each graph dynamo hands it to `graphs`.
- `assert_close_step(got, want, device)`: loss and every gradient equal within the device's tolerance.
- `no_graph_caches()`: inductor's and AOT autograd's graph caches off, its kernel cache kept.
"""

from __future__ import annotations

import contextlib

import torch

from hybridtune.data.collator import varlen_metadata
from hybridtune.models.presets import preset_config

LAYOUTS = [[10, 30, 35], [64, 11], [5, 5, 5, 5, 90], [33, 1, 19, 60]]
DEPTH = 8


def deep_config(name: str, depth: int = DEPTH):
    cfg = preset_config(name, vocab_size=256)
    cfg.num_hidden_layers = depth
    cfg.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(depth)]
    return cfg


def loop_model(cfg, device: str, lora: bool, ckpt: bool):
    """The model of `cfg` (seed 0) on `device`, checkpointed and LoRA-wrapped as asked, patched, in train mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hybridtune.models.patching import patch_model

    torch.manual_seed(0)
    # transformers' CPU grouped-mm fallback has a data-dependent backward that AOT autograd cannot trace;
    # batched_mm is its traceable expert implementation (MoE experts are not routed by hybridtune).
    kw = {"experts_implementation": "batched_mm"} if getattr(cfg, "num_experts", 0) else {}
    model = AutoModelForCausalLM.from_config(cfg, **kw).to(device)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()  # peft's usual companion of checkpointing: a requires_grad_() hook
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"]))
    patch_model(model)
    if device == "cuda":
        # The FLA backward runs only for head layouts the device self-test verified (as the trainer does).
        from hybridtune.kernels.selftest import layouts_from_config, verify

        verdicts = verify(layouts_from_config(model.config))
        assert verdicts and all(v.passed for v in verdicts), [v.verdict for v in verdicts]
    return model.train()


def deep_model(device: str, lora: bool, ckpt: bool, name: str = "tiny-qwen3_5", depth: int = DEPTH):
    return loop_model(deep_config(name, depth), device, lora, ckpt)


def recording_backend(backend, graphs, regional=False):
    """`backend`, keeping each graph dynamo hands it. Inductor gets the options compile_loop gives a loop of
    `regional` layers (`inductor_settings`: buffer reuse off), fed to the backward's lazy compile too: a wrapper
    that called inductor plainly would test a configuration the product never runs."""
    from torch._dynamo.backends.registry import lookup_backend

    from hybridtune.compiler.loop import inductor_settings

    options = inductor_settings(backend, None, regional).get("options")

    def recording(gm, example_inputs):
        graphs.append(gm)
        if backend == "inductor" and options:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches=dict(options))
        return lookup_backend(backend)(gm, example_inputs)

    return recording


def packed_batch(lens, device, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    ids = torch.randint(0, 256, (1, T), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    b = {"input_ids": ids, "labels": ids.clone(), "position_ids": pos, **varlen_metadata(lens)}
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}


def train_step(model, batch):
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def assert_close_step(got, want, device):
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=2e-3, atol=2e-4)
    loss_c, grads_c = got
    loss_e, grads_e = want
    torch.testing.assert_close(loss_c, loss_e, **tol)
    assert grads_c.keys() == grads_e.keys() and grads_c
    for n in grads_e:
        torch.testing.assert_close(grads_c[n], grads_e[n], **tol, msg=n)


@contextlib.contextmanager
def no_graph_caches():
    """No compiled graph from a cache answers (inductor's FX graph cache and AOT autograd's cache off: a graph
    compiled under other settings, an earlier test's or run's, must not stand in for this one). The kernel cache
    stays on: a C++ kernel is found there by the hash of its whole source and build command, so only the same
    kernel answers, and the session's inductor tests share the kernels they have in common instead of building each
    again (`force_disable_caches` would give every compile an empty cache directory)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    with config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
