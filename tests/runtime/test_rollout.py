"""In-process rollouts (runtime/rollout.py) on the tiny presets, CPU: greedy decoding equals transformers' `generate`
token for token (a LoRA policy with its adapters live, and a full model); a group sampled from one prefill with its
cache copied to every row equals each row generated alone (the same generator per row), token for token; top-p is
transformers' warper; an end-of-turn id ends a row and is kept, a row without one is marked truncated."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import TopPLogitsWarper

from hybridtune.config import load_config
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import tokenizer_for
from hybridtune.runtime.model import build_model
from hybridtune.runtime.rollout import Rollout, filter_top_p, sample_group, sample_groups

PRESETS = ["tiny-qwen3_5", "tiny-qwen3_next"]


def policy(preset: str, adapter: str):
    cfg = load_config(
        None,
        {"base_model": preset, "adapter": adapter, "lora_dropout": 0.1 if preset == "tiny-qwen3_5" else 0.0, "seed": 1},
    )
    tok = tokenizer_for(preset)
    torch.manual_seed(1)
    model = build_model(cfg, resolve_source(preset), tok, torch.device("cpu"), bf16=False).model
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # LoRA's B starts at zero: move it, so the adapters change the generations
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if adapter == "lora" else 0.05))
    model.train()  # as the trainer holds it: the rollout must switch dropout off and back
    return model


def prompts(n: int, seed: int, vocab: int = 400) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_greedy_equals_transformers_generate_token_for_token(preset, adapter):
    model = policy(preset, adapter)
    for prompt in prompts(3, seed=7):
        (got,) = sample_group(model, prompt, [None], 12, stop=[], temperature=0.0)
        assert model.training  # put back
        ids = torch.tensor([prompt])
        model.eval()
        config = GenerationConfig(max_new_tokens=12, min_new_tokens=12, do_sample=False, num_beams=1, eos_token_id=None)
        with torch.no_grad():
            want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        model.train()
        assert got == Rollout(want[0, len(prompt) :].tolist(), truncated=True)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_group_from_one_copied_prefill_equals_each_row_generated_alone(preset):
    model = policy(preset, "lora")
    (prompt,) = prompts(1, seed=3)

    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    seeds = [11, 12, 13, 14, 15]
    group = sample_group(model, prompt, gens(seeds), 10, stop=[], temperature=1.3, top_p=0.9)
    alone = [sample_group(model, prompt, gens([s]), 10, stop=[], temperature=1.3, top_p=0.9)[0] for s in seeds]
    assert group == alone
    assert len({tuple(r.ids) for r in group}) > 1  # the rows sample differently
    # the stop id ends a row (kept); rows stop at their own length; the others run to max_new_tokens
    stop = group[0].ids[4]
    cut = sample_group(model, prompt, gens(seeds), 10, stop=[stop], temperature=1.3, top_p=0.9)
    for full, got in zip(group, cut):
        end = full.ids.index(stop) if stop in full.ids else None
        assert got == (Rollout(full.ids, True) if end is None else Rollout(full.ids[: end + 1], False))
    again = sample_groups(model, [prompt, prompt], 2, 6, [], temperature=1.0, seed=5)
    assert again == sample_groups(model, [prompt, prompt], 2, 6, [], temperature=1.0, seed=5)  # reproducible
    assert again[0] != again[1]  # each row its own generator


def test_top_p_is_transformers_warper():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    for p in (0.3, 0.8, 0.95):
        want = TopPLogitsWarper(p)(None, logits.clone())
        assert torch.equal(filter_top_p(logits, p), want)


@pytest.mark.parametrize("preset", PRESETS)
def test_prompts_of_different_lengths_decoded_together_equal_each_alone(preset):
    """sample_groups decodes every prompt's rows in one left-padded static state: each prompt's group equals the
    group sampled with that prompt alone (same seeds), token for token, and the buffers are reused by the next
    rollout of the same size."""
    model = policy(preset, "lora")
    ps = prompts(3, seed=11)
    assert len({len(p) for p in ps}) > 1
    together = sample_groups(model, ps, 2, 7, [], temperature=1.1, seed=40)
    kept = model._hybridtune_decoder
    assert sample_groups(model, ps, 2, 7, [], temperature=1.1, seed=40) == together
    assert model._hybridtune_decoder is kept  # same rows and length: the same buffers
    for i, p in enumerate(ps):
        gens = [torch.Generator().manual_seed(40 + i * 2 + j) for j in range(2)]
        assert together[i] == sample_group(model, p, gens, 7, stop=[], temperature=1.1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_decoder_equals_the_eager_one_on_cuda(caplog):
    """On a GPU the decode step is compiled with CUDA graphs, checked, and then decodes as the eager step does: fp32
    (no autocast), greedy, 40 tokens for 6 rows of different prompts."""
    model = policy("tiny-qwen3_5", "lora").cuda()
    ps = prompts(6, seed=5)
    from hybridtune.runtime import rollout

    with caplog.at_level("INFO", logger="hybridtune.runtime.rollout"):
        got = sample_groups(model, ps, 1, 40, [], temperature=0.0)
    assert model._hybridtune_decoder.how in ("compiled, CUDA graphs", "one CUDA graph"), caplog.text
    eager = rollout.Decoder(model, 6, model._hybridtune_decoder.length, torch.device("cuda"))
    eager.compiled = False
    object.__setattr__(model, "_hybridtune_decoder", eager)
    want = sample_groups(model, ps, 1, 40, [], temperature=0.0)
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_the_decode_step_traces_as_one_graph_and_equals_eager(preset):
    """The decode step, with the decoder's own masks, traces whole under Dynamo on the CPU's ops (fullgraph: no
    graph break, no data-dependent branch) and the traced step gives the eager step's logits on the same state.
    (On the H200 the compiled step failed with "Data-dependent branching" in a GPU-only part not found yet: FLA's
    recurrent kernel is the difference; benchmarks/reports/2026-12-04b-dpo-grpo-on-h200.md.)"""
    from hybridtune.runtime.rollout import Decoder, _restore, _state

    model = policy(preset, "lora")
    model.eval()
    ps = prompts(3, seed=9)
    dec = Decoder(model, 3, 64 + 4, torch.device("cpu"))
    with torch.no_grad():
        logits, pos = dec.prefill(ps, pad=0)
        tok = logits.argmax(-1)[:, None]
        dec.mask[:, dec.width] = True
        saved = _state(dec.cache)
        want = dec._step(tok, pos)
        _restore(dec.cache, saved)
        torch._dynamo.reset()
        got = torch.compile(dec._step, fullgraph=True, backend="eager")(tok, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
