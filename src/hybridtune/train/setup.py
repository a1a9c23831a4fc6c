"""The trainer's setup (`TrainerSetup`, which `trainer.Trainer` runs from): `setup()` reads as a table of contents,
each part wiring one piece of the run: the output directory and its record, the data (through the objective's spec,
train/objectives/spec.py: its loading, checks and preparation; the trainer names no objective), the kernels, the
model, every `auto` choice, the engine (runtime/compose.py) and the objective's rollouts when it samples, the FLOP
count, the optimizer and data stream, the resume, the metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections.abc import Callable
from pathlib import Path

import torch

from hybridtune.config import TrainConfig, warmup_warning
from hybridtune.data import with_chat_template
from hybridtune.data.build import PreparedData
from hybridtune.data.digests import one_read
from hybridtune.data.packing import Example
from hybridtune.data.report import to_jsonl
from hybridtune.files import atomic_write_text
from hybridtune.kernels.environment import use_compile_caches
from hybridtune.kernels.provision import provision_for
from hybridtune.models.flops import measure_peak
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import tokenizer_for
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.base import base_revision
from hybridtune.run.lock import OutputLock
from hybridtune.run.outdir import DATA_REPORT, RUN_FILE, claim_output_dir, tidy, write_run_file
from hybridtune.run.resume import find_resume, load_checkpoint
from hybridtune.run.space import fit_run
from hybridtune.runtime import compose as compose_step
from hybridtune.runtime import cudagraphs, distributed
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.runtime.choices import Choices, Facts, choose_bf16, pick_device, resolve
from hybridtune.runtime.compose import compose
from hybridtune.runtime.defaults import RESOLVED, recorded_values, resolve_defaults
from hybridtune.runtime.measure import measure
from hybridtune.runtime.metrics import MetricsLog, StepFlops
from hybridtune.runtime.model import build_model
from hybridtune.runtime.signals import StopRequest, sigterm_interrupts
from hybridtune.runtime.stream import BatchStream
from hybridtune.runtime.vision import vision_for
from hybridtune.train.evaluation import eval_batches
from hybridtune.train.objectives import check_keys, spec_of
from hybridtune.train.trackers import open_metrics

logger = logging.getLogger(__name__)


class TrainerSetup:
    def __init__(self, cfg: TrainConfig, on_log: Callable[[dict], None] | None = None):
        self.cfg = cfg
        self.on_log = on_log
        # Before pick_device: under torchrun on CUDA this selects the rank's GPU.
        self.dist = distributed.init(cfg.distributed, adapter_kind(cfg), cfg.device)
        self.device = pick_device(cfg.device)
        self.out = Path(cfg.output_dir)
        self.metrics: MetricsLog | None = None
        self.stop = StopRequest()
        self.lock: OutputLock | None = None
        self.run: dict | None = None  # rank 0: `outdir.run_record`
        self.saved_step = -1  # the step of this process's newest checkpoint
        self.cuda_graphs, self.conv_before = False, None  # CUDA graphs on; the undo of the mixers' settings for them

    # -- setup: a table of contents ----------------------------------------------------------------

    def setup(self) -> None:
        try:
            with sigterm_interrupts():  # a SIGTERM before training stops like Ctrl-C does here: cleanly, at once
                self._setup()
        except BaseException:
            if self.lock is not None:  # refused or failed before writing anything: leave no trace
                self.lock.release(discard=not (self.out / RUN_FILE).exists())
                self.lock = None
            self.close()  # (and the mixers' settings for CUDA graphs undone)
            raise

    def _setup(self) -> None:
        with one_read():  # the run record and the tokenisation cache key digest the same data: read it once
            self._setup_output_dir()
            self._setup_data()  # before the model: bad input fails in a second, not after a model load
        self._setup_kernels()  # before anything imports the modeling module, where transformers picks its path
        self._setup_model()
        self._setup_choices()
        self._setup_engine()
        self._setup_flops()
        self._setup_optimizer()
        self._setup_resume()
        self.cfg = fit_run(self.cfg, self.engine, self.built, self.tokenizer, self.step, self.total_steps, self.dist)
        self._setup_metrics()

    def _setup_output_dir(self) -> None:
        cfg = self.cfg
        distributed.check_window(self.dist, cfg.gradient_accumulation_steps)

        def claim() -> bool:
            fresh, self.lock, self.run = claim_output_dir(cfg)  # the lock, and the record every checkpoint carries
            return fresh

        self.fresh_metrics = distributed.main_only(self.dist, claim)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)

    def _setup_data(self) -> None:
        # The checkpoint to resume from, verified (checksums of every file) before anything in it is read; first,
        # because a resume loads the base at the commit its checkpoint trained on (a moved branch moves no run).
        self.resume_at = self._find_resume()
        self.source = resolve_source(
            self.cfg.base_model, base_revision(self.cfg, self.resume_at)
        )  # a hub id: its local snapshot
        tokenizer = tokenizer_for(self.source, self.cfg.tokenizer)
        self.tokenizer = with_chat_template(tokenizer, self.cfg.chat_template)
        # A vision-language checkpoint's image processor, for the rows' images (None for a text-only model).
        self.vision = vision_for(self.source, self.tokenizer, self.cfg.min_pixels, self.cfg.max_pixels)
        # The objective's data: its own loading and checks (preference pairs, an on-policy objective's prompts).
        self.spec = spec_of(self.cfg.objective)
        check_keys(self.cfg)  # (another objective's keys set for this one: one line)
        loaded = self.spec.load(self.cfg, self.tokenizer, self.vision)
        # learning_rate and sequence_len `auto` by what the model is, before packing; a resume keeps its run's.
        recorded = recorded_values(ckpt.meta_of(self.resume_at).get("run")) if self.resume_at else {}
        defaults = resolve_defaults(self.cfg, self.source, loaded.train_lengths(), recorded)
        defaults.log(logger)
        self.cfg = defaults.apply(self.cfg)  # numbers from here on; the run record keeps the `auto`s and these
        if self.run is not None:
            self.run[RESOLVED] = defaults.resolved()
        self.data: PreparedData = self.spec.prepare(self.cfg, self.tokenizer, loaded)  # (preference data: whole pairs)

    def _find_resume(self) -> Path | None:
        if not self.cfg.resume_from_checkpoint:
            return None
        path, skipped = find_resume(self.cfg.resume_from_checkpoint, self.out, self.dist)
        for line in skipped:  # (`latest` skips a damaged newest one, saying so)
            logger.warning("%s", line)
        return path

    def _setup_kernels(self) -> None:
        if self.device.type == "cuda" or self.cfg.compile in ("loop", "modules"):  # before the self-test compiles
            logger.info("%s", use_compile_caches())
        self.kernel_report = provision_for(self.cfg, self.source.config_ref)

    def _facts(self, model: torch.nn.Module | None = None) -> Facts:
        """What the choices depend on (`runtime/measure.py`); without a model, what is known before it loads."""
        if model is None:
            return measure(self.cfg, self.device, self.dist)
        packs = [tuple(len(e) for e in b) for b in self.data.bins]
        packs += [tuple(len(e) for e in b) for b in eval_batches(self._eval_examples(), self.cfg.sequence_len)]
        return measure(self.cfg, self.device, self.dist, model, self.use_bf16, packs)

    def _setup_model(self) -> None:
        """Load, patch the mixers, checkpointing, LoRA, on the device; the dtypes are runtime/model.py's."""
        self.use_bf16 = choose_bf16(self.cfg, self._facts()).value
        built = build_model(self.cfg, self.source, self.tokenizer, self.device, self.use_bf16, self.dist)
        self.built, self.loaded, self.model, self.patch_report = built, built.loaded, built.model, built.patch_report

    def _setup_choices(self) -> None:
        self.facts = self._facts(self.model)
        self.choices: Choices = resolve(self.cfg, self.facts)
        self.choices.log(logger)  # a line per choice, each followed by its warnings
        if self.choices.threads.value is not None:
            torch.set_num_threads(self.choices.threads.value)
        self.strategy = self.choices.compile.value
        if self.dist.engine == "fsdp":
            self.dist = dataclasses.replace(self.dist, units=self.choices.fsdp_units.value)
        layout = self.choices.pack_layout.value
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.collate = self.spec.collator(self.data)(layout=layout, pad_token_id=pad)
        self.collate.vision = self.vision  # (packs with images: the vision tower's input, M-RoPE rows)
        self.objective = self.spec.build(self.cfg, self.choices.fused_loss.value, self.model)

    def _setup_engine(self) -> None:
        """After patching, LoRA and checkpointing: CUDA graphs, the compile, the engine (runtime/compose.py, the
        composition `hybridtune bench` shares): the model itself in one process, DDP- or FSDP2-wrapped under
        torchrun (FSDP2's unit is `choices.fsdp_units`). Eval runs the forward alone: DDP's copy needs no engine;
        FSDP2's shards must gather (all ranks)."""
        c = compose(self.built, self.cfg, self.choices, self.objective, self.device, self.dist, self.facts.packs)
        self.composed, self.engine, self.eval_model, self.autocast = c, c.engine, c.eval_model, c.autocast
        self.compile_handle, self.cuda_graphs, self.graph_log, self.conv_before = (
            c.compile_handle, c.cuda_graphs, c.graph_log, c.conv_before
        )  # fmt: skip
        if self.strategy != "off":
            logger.info("compile: strategy '%s' (the first step includes compilation)", self.strategy)
        args = (self.cfg, self.objective, self.tokenizer, self.model, self.device, self.autocast, self.dist.world)
        self.rollouts = self.spec.rollouts(*args) if self.spec.rollouts is not None else None  # (on-policy: grpo)

    def _setup_flops(self) -> None:
        """MFU in the step line: the model FLOPs of each step over the measured matmul peak of the run's devices."""
        cfg = self.cfg
        try:
            self.step_flops = StepFlops(self.model, adapter_kind(cfg), cfg.lora_r, cfg.lora_target_modules)
        except (AttributeError, ValueError, TypeError) as e:
            self.step_flops = None
            logger.info("mfu: not reported, the FLOP count does not know this model (%s)", e)
        self.peak_flops = measure_peak(self.device)["flops_per_s"] * self.dist.world if self.step_flops else None

    def _setup_optimizer(self) -> None:
        """The data stream, then the optimizer (`params`: what holds the gradients) and the learning-rate schedule
        (runtime/compose.py's `optimization`, the bench's too)."""
        cfg = self.cfg
        self.stream = BatchStream(self.data.bins, cfg.micro_batch_size, cfg.seed)
        per_epoch = math.ceil(self.stream.micro_batches_per_epoch() / cfg.gradient_accumulation_steps)
        self.total_steps = cfg.max_steps if cfg.max_steps >= 0 else max(1, math.ceil(per_epoch * cfg.num_epochs))
        if cfg.max_steps < 0 and self.dist.is_main and (warn := warmup_warning(cfg, self.total_steps)):
            logger.warning("%s", warn)  # (with max_steps set, load_config has said it)
        o = compose_step.optimization(self.composed, cfg, self.total_steps, self.dist)
        self.optimizer, self.params, self.scheduler = o.optimizer, o.params, o.scheduler  # (params: fp32 masters')
        self.step, self.done_position = 0, self.stream.position()  # the data position after the last completed step

    def _setup_resume(self) -> None:
        if self.dist.enabled:
            # Dropout differs per rank (the model init above was the same everywhere: FSDP2 does not broadcast).
            # A resumed run then restores each rank's own RNG state.
            torch.manual_seed(self.cfg.seed + self.dist.rank)
        path = self.resume_at
        if path is None:
            return
        only = adapter_kind(self.cfg).trainable_only
        state = load_checkpoint(
            path, self.engine, self.optimizer, self.scheduler, self.dist, trainable_only=only, verified=True
        )
        self.stream.seek(state["data_position"])
        self.done_position = self.stream.position()
        self.step = self.saved_step = state["step"]
        written = f" (written by {state['world']} process(es))" if state.get("world", 1) != self.dist.world else ""
        logger.info("resumed from %s at step %d%s", path, self.step, written)

    def _setup_metrics(self) -> None:
        cfg, d = self.cfg, self.dist
        # Only now, with data, model and resume checked, is anything an earlier run left removed.
        distributed.main_only(d, lambda: tidy(cfg, self.fresh_metrics))
        if d.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            write_run_file(self.out, self.run)
            # Every truncated or dropped row, where and why (an empty file: every row trained whole).
            atomic_write_text(self.out / DATA_REPORT, to_jsonl(self.data.report))
        # A resumed run drops the rows an earlier process logged after its checkpoint: they are logged again.
        self.metrics = open_metrics(cfg, self.out, self.fresh_metrics, self.step) if d.is_main else None
        procs = f" x {d.world} processes ({d.engine})" if d.enabled else ""
        bins = cfg.micro_batch_size * cfg.gradient_accumulation_steps
        logger.info(
            f"training {self.loaded.name} ({cfg.adapter}) on {self.device}{procs}: {self.total_steps} steps, {bins} "
            f"bins/step of {cfg.sequence_len} tokens, lr {cfg.learning_rate:.1e} {cfg.lr_scheduler}"
        )

    def close(self) -> None:  # let go of the output directory's lock; the mixers' CUDA-graph settings undone
        self.lock = self.lock.release() if self.lock is not None else None
        if self.conv_before is not None:
            self.conv_before = cudagraphs.restore(self.conv_before)

    def _eval_examples(self) -> list[Example]:
        """The held-out examples every evaluation reads (the static layout is fitted over their packs too)."""
        return self.data.eval_examples[: self.cfg.eval_max_examples]
