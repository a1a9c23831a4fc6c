"""`keep_mixer_cores: auto | true | false` (choices.choose_keep_mixer_cores): under checkpointing the compiled loop's
checkpoints keep the mixers' cores (compiler/recompute.py) in one process when the memory estimate with them kept
fits, and say so with the figures; they are recomputed where the estimate does not fit, under torchrun, without the
loop, or when asked. The FLOP count follows what the layers' checkpoint functions do. The old key, of the
opposite polarity, is refused with the new name."""

from __future__ import annotations

import pytest

from hybridtune.compiler import recompute
from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.models.flops import step_flops
from hybridtune.models.presets import preset_config
from hybridtune.runtime import facts
from hybridtune.runtime.adapter_kind import FULL
from hybridtune.runtime.choices import Facts, choose_keep_mixer_cores
from hybridtune.runtime.memory import GIB, ActivationShapes, step_bytes

SHAPES_2B = ActivationShapes.of(preset_config("qwen3_5-2b"))
LORA_STATE = 3 * 4 * 21_000_000


def _facts(**kw) -> Facts:
    base = dict(device="cuda", bf16_supported=True, gpu_free_bytes=135 * GIB, state_bytes=LORA_STATE, shapes=SHAPES_2B)
    return Facts(**{**base, **kw})


def _choose(seq_len: int, strategy: str = "loop", checkpointing: bool = True, **kw):
    over = {"sequence_len": seq_len, **{k: v for k, v in kw.items() if k in ("keep_mixer_cores",)}}
    facts = _facts(**{k: v for k, v in kw.items() if k != "keep_mixer_cores"})
    return choose_keep_mixer_cores(load_config(None, over), facts, strategy, checkpointing, None, True, True)


def test_the_cores_cost_what_they_keep():
    s = SHAPES_2B
    assert s.core_elements("linear_attention") == 2048 + 64 * 16 + 2 * 16  # output, WY matrix, fp32 gate
    assert s.core_elements("full_attention") == 2048 + 2 * 8  # output, fp32 log-sum-exp
    est = step_bytes(s, 4096, bf16=True, fused_loss=True, state_bytes=0)
    per_token = sum(s.core_elements(k) for k in s.layer_types) * 2
    assert est.keeping_cores - est.with_checkpointing == 4096 * per_token
    assert est.with_checkpointing < est.keeping_cores < est.without


def test_auto_keeps_them_where_they_fit_and_says_so():
    c = _choose(4096)
    assert c.value is True and c.reason.startswith("auto: kept: 4096-token micro-batches need about ")
    tight = _choose(262144, gpu_free_bytes=60 * GIB)  # checkpointed it fits, keeping the cores it would not
    assert tight.value is False and tight.reason.startswith("auto: recomputed: keeping them would need about ")


@pytest.mark.parametrize(
    "kw,value,reason",
    [
        ({"checkpointing": False}, False, "no checkpointing: nothing is recomputed"),
        ({"strategy": "modules"}, False, "auto: compile modules: only the loop keeps them"),
        ({"engine": "ddp", "world": 2}, False, "auto: recomputed under ddp: keeping them is not yet checked there"),
        ({"device": "cpu", "gpu_free_bytes": None}, False, "auto: recomputed, no GPU memory to plan for"),
        ({"keep_mixer_cores": False}, False, "keep_mixer_cores: false"),
        ({"keep_mixer_cores": True}, True, "keep_mixer_cores: true"),
        ({"keep_mixer_cores": True, "checkpointing": False}, True, "keep_mixer_cores: true"),  # for an OOM retry
        (
            {"keep_mixer_cores": True, "engine": "fsdp", "world": 2},
            True,
            "keep_mixer_cores: true; not yet checked under fsdp",
        ),
    ],
)
def test_where_they_are_kept_or_recomputed(kw, value, reason):
    c = _choose(4096, **kw)
    assert (c.value, c.reason, c.warnings) == (value, reason, ())


def test_an_explicit_true_without_the_loop_warns_with_its_choice():
    c = _choose(4096, strategy="modules", keep_mixer_cores=True)
    assert c.value is False and c.reason == "compile modules: only the loop keeps them"
    assert c.warnings == ("keep_mixer_cores: true has no effect under compile strategy 'modules' (the loop's)",)


@pytest.mark.parametrize("old,new", [(True, "false"), (False, "true"), ("auto", "auto")])
def test_the_old_key_names_the_new_one_and_the_inverted_polarity(old, new):
    with pytest.raises(ConfigError) as e:
        load_config(None, {"recompute_cores": old})
    msg = str(e.value)
    assert "config key 'recompute_cores' is now 'keep_mixer_cores' with the polarity inverted" in msg
    assert msg.endswith(f"write 'keep_mixer_cores: {new}'") and "\n" not in msg


def test_the_choice_is_logged_after_checkpointing():
    assert facts.ORDER.index("keep_mixer_cores") == facts.ORDER.index("checkpointing") + 1


def test_the_flop_count_reads_the_checkpoint_functions():
    from hybridtune.runtime.metrics import StepFlops

    cfg = preset_config("tiny-qwen3_5", vocab_size=256)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    flops = StepFlops(model, FULL, 0, [])
    plain = flops([40, 24])
    for m in model.modules():
        if hasattr(m, "_gradient_checkpointing_func"):
            m._gradient_checkpointing_func = recompute.checkpoint_fn(True)
    kept = flops([40, 24])
    want = step_flops(cfg, [40, 24], adapter="full", gradient_checkpointing=True, keep_mixer_cores=True)
    assert kept == (want.model, want.hardware) and kept[0] == plain[0] and kept[1] < plain[1]
    assert recompute.keeps_cores(next(m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")))
    assert not recompute.checkpoint_fn(False).__dict__[recompute.KEEPS]
