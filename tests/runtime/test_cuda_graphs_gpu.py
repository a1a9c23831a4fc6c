"""CUDA graphs on the GPU (`-m cuda`): the compiled loop under "reduce-overhead" over a static layout equals the eager
step (loss and every gradient) for every layout, the first call of each chunk count and its replays alike, with and
without gradient checkpointing, LoRA and full, and with gradients accumulated over micro-batches; a graph per chunk
count at most, none skipped; regional (train's default) and inlined. Then the trainer: `cuda_graphs: auto` is on for
the compiled loop (regional) and follows the curve of `cuda_graphs: off`."""

from __future__ import annotations

import pytest
import torch

from hybridtune.batch import NUM_LOSS_TOKENS
from hybridtune.data.collator import PackedCollator, StaticLayout
from hybridtune.data.packing import Example
from hybridtune.models.presets import preset_config
from hybridtune.runtime import choices, cudagraphs
from hybridtune.train.trainer import Trainer
from train_runs import make_cfg

pytestmark = pytest.mark.cuda

# Document lengths of the packs: the static layout fitted over them gives several GDN chunk counts.
PACKS = [[10, 30, 35], [64, 11], [5, 5, 5, 5, 90], [130], [33, 1, 19, 60], [129, 1], [3, 64, 64]]
TOL = dict(rtol=2e-3, atol=2e-4)


def _model(adapter: str, gc: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hybridtune.kernels.selftest import layouts_from_config, verify
    from hybridtune.models.patching import patch_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256)).cuda()
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if adapter == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"]))
        for n, p in model.named_parameters():  # non-zero B: every LoRA gradient is informative
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
    patch_model(model)
    verdicts = verify(layouts_from_config(model.config))  # FLA's backward runs for verified head layouts only
    assert verdicts and all(v.passed for v in verdicts), [v.verdict for v in verdicts]
    return model.train()


def _batches(layout: StaticLayout) -> list[dict]:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    collate = PackedCollator(layout=layout)
    out = []
    for lens in PACKS:
        docs = [Example(torch.randint(0, 256, (n,), generator=gen).tolist(), [1] * n) for n in lens]
        out.append({k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in collate(docs).items()})
    return out


def _loss(model, batch):
    from hybridtune.train.objectives.sft import sft_loss

    return sft_loss(model, batch, batch[NUM_LOSS_TOKENS], fused=True)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# Regional (each distinct layer one traced body: what `hybridtune train` compiles by default) for every case, and the
# inlined loop (`compile_regions: false`) for one; checkpoints keeping the mixers' cores (`recompute_cores: auto` under
# checkpointing on a GPU: compiler/recompute.py) for one.
@pytest.mark.parametrize(
    "adapter,gc,regional,keep_cores",
    [
        ("lora", True, True, False),
        ("lora", False, True, False),
        ("full", True, True, False),
        ("lora", True, False, False),
        pytest.param("lora", True, True, True, id="lora-gc-regional-sac"),
    ],
)
def test_cuda_graph_step_equals_eager_over_layouts(adapter, gc, regional, keep_cores):
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    from hybridtune.compiler.loop import compile_loop

    torch._dynamo.reset()
    reset_cudagraph_trees()  # this test's graphs alone are counted
    model = _model(adapter, gc)
    layout = StaticLayout.fit(PACKS, max_filler=1.0)
    keys = choices.cuda_graph_keys(layout, [tuple(p) for p in PACKS])
    assert len(keys) >= 3  # several chunk counts: several graphs
    batches = _batches(layout)
    eager = []
    for b in batches:
        loss = _loss(model, b)
        loss.backward()
        eager.append((loss.detach().clone(), _grads(model)))
        model.zero_grad(set_to_none=True)

    conv = cudagraphs.before_compile(len(keys))
    try:
        compile_loop(model, mode=cudagraphs.MODE, static_shapes=True, regional=regional, keep_cores=keep_cores)
        counters.clear()
        for _ in range(3):  # the first call of a size warms up, the second records, the third replays
            for b, (loss_e, grads_e) in zip(batches, eager):
                cudagraphs.step_begin(True)
                loss = _loss(model, b)
                loss.backward()
                torch.testing.assert_close(cudagraphs.kept(loss), loss_e, **TOL)
                grads = _grads(model)
                assert grads.keys() == grads_e.keys() and grads
                for n in grads_e:
                    torch.testing.assert_close(grads[n], grads_e[n], **TOL, msg=n)
                model.zero_grad(set_to_none=True)
        assert counters["inductor"]["cudagraph_skips"] == 0  # every graph ran as a CUDA graph
        n = cudagraphs.recorded(torch.device("cuda", torch.cuda.current_device()))
        # Forward and backward, once per chunk count: the pool's bound.
        assert n is not None and len(keys) <= n <= 2 * len(keys), (n, sorted(keys))

        # Two micro-batches accumulated into buffers outside the pool: the sum of their eager gradients.
        params = [p for p in model.parameters() if p.requires_grad]
        cudagraphs.stable_grads(params)
        for b in batches[:2]:
            cudagraphs.step_begin(True)
            _loss(model, b).backward()
        acc = _grads(model)
        for name in acc:
            torch.testing.assert_close(acc[name], eager[0][1][name] + eager[1][1][name], **TOL, msg=name)
    finally:
        cudagraphs.restore(conv)


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_trainer_cuda_graphs_follow_the_curve_without(tmp_path, small_data, adapter):
    def run(cg: str):
        torch._dynamo.reset()
        cfg = make_cfg(
            tmp_path / cg, small_data, adapter=adapter, device="cuda", compile="loop", pack_layout="static",
            cuda_graphs=cg, max_steps=6, eval_steps=3, lora_dropout=0.0, gradient_accumulation_steps=2,
        )  # fmt: skip
        t = Trainer(cfg)
        t.setup()
        return t, t.train()

    off_t, off = run("off")
    on_t, on = run("auto")
    assert off_t.choices.cuda_graphs.value is False and on_t.choices.cuda_graphs.value is True
    assert on_t.choices.compile_regions.value is True  # train's default: the regional loop under CUDA graphs
    assert on_t.cuda_graphs and (cudagraphs.recorded(on_t.device) or 0) > 0
    assert len(on.losses) == len(off.losses) == 6
    assert max(abs(a - b) / abs(b) for a, b in zip(on.losses, off.losses)) < 1e-2, (on.losses, off.losses)
    for a, b in zip(on.evals, off.evals):
        assert abs(a["eval_loss"] - b["eval_loss"]) / b["eval_loss"] < 1e-2
