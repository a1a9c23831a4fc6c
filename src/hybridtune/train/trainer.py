"""The trainer: wires the run's parts together and runs its steps. Each part lives in its own module:

    runtime/  choices.py (every `auto` resolved once, with its reason; memory.py its estimate), model.py, stream.py
              (data order and position), step.py (one micro-batch's loss; cudagraphs.py), distributed.py (DDP /
              FSDP2, the window split over ranks), profiling.py, oom.py (the first step's out-of-memory retry)
    run/      outdir.py (which runs a directory may hold), checkpoint.py (atomic DCP checkpoints, exact resume),
              export.py (the final model or adapter), plots.py (loss.png and the other curves)
    train/    evaluation.py (held-out loss and exact match)

An optimizer step's loss is the mean over every trained token of its micro-batches (the window's token count is known
before the first forward), so k micro-batches equal one batch k times as large; under torchrun each rank runs its
share of the window with the same whole-window count.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hybridtune.batch import NUM_LOSS_TOKENS, NUM_TOKENS
from hybridtune.config import TrainConfig, warmup_warning
from hybridtune.data import with_chat_template
from hybridtune.data.build import PreparedData, load_data
from hybridtune.data.digests import one_read
from hybridtune.data.packing import Example
from hybridtune.data.report import to_jsonl
from hybridtune.errors import TrainingDiverged
from hybridtune.files import atomic_write_text
from hybridtune.kernels.environment import use_compile_caches
from hybridtune.kernels.provision import provision_for
from hybridtune.models.flops import measure_peak
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import tokenizer_for
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import export
from hybridtune.run.base import base_identity, base_revision
from hybridtune.run.card import model_card
from hybridtune.run.outdir import DATA_REPORT, RUN_FILE, OutputLock, claim_output_dir, tidy, write_run_file
from hybridtune.run.plots import plot_run
from hybridtune.run.resume import find_resume, load_checkpoint
from hybridtune.run.space import fit_run
from hybridtune.runtime import compose as compose_step
from hybridtune.runtime import cudagraphs, distributed, health, oom
from hybridtune.runtime.choices import Choices, Facts, choose_bf16, pick_device, resolve
from hybridtune.runtime.compose import compose
from hybridtune.runtime.defaults import RESOLVED, recorded_values, resolve_defaults
from hybridtune.runtime.measure import measure
from hybridtune.runtime.metrics import MetricsLog, StepFlops, StepLog, memory_gib
from hybridtune.runtime.model import build_model
from hybridtune.runtime.optim import masters_into_model
from hybridtune.runtime.profiling import ProfileWindow
from hybridtune.runtime.signals import StopRequest, sigterm_interrupts
from hybridtune.runtime.stream import BatchStream, to_device
from hybridtune.runtime.vision import vision_for
from hybridtune.train.evaluation import eval_batches, evaluate, report_eval
from hybridtune.train.objectives import build_objective
from hybridtune.train.objectives.grpo_rollouts import Rollouts, load_prompts, on_policy, prepare_prompts
from hybridtune.train.objectives.preference import collator_for, prepare_data
from hybridtune.train.objectives.rewards import RewardError
from hybridtune.train.result import TrainResult  # (importable from here, as before)
from hybridtune.train.samples import generate_samples
from hybridtune.train.trackers import open_metrics

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: TrainConfig, on_log: Callable[[dict], None] | None = None):
        self.cfg = cfg
        self.on_log = on_log
        # Before pick_device: under torchrun on CUDA this selects the rank's GPU.
        self.dist = distributed.init(cfg.distributed, cfg.adapter, cfg.device)
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
        grpo = on_policy(self.cfg)  # (an on-policy objective's data are prompts)
        loaded = (load_prompts if grpo else load_data)(self.cfg, self.tokenizer, self.vision)
        # learning_rate and sequence_len `auto` by what the model is, before packing; a resume keeps its run's.
        recorded = recorded_values(ckpt.meta_of(self.resume_at).get("run")) if self.resume_at else {}
        defaults = resolve_defaults(self.cfg, self.source, loaded.train_lengths(), recorded)
        defaults.log(logger)
        self.cfg = defaults.apply(self.cfg)  # numbers from here on; the run record keeps the `auto`s and these
        if self.run is not None:
            self.run[RESOLVED] = defaults.resolved()
        prepare = prepare_prompts if grpo else prepare_data  # (preference data: whole pairs)
        self.data: PreparedData = prepare(self.cfg, self.tokenizer, loaded)

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
        """What the choices depend on (`choices.measure`); without a model, what is known before it loads."""
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
        self.collate = collator_for(self.data)(layout=layout, pad_token_id=pad)
        self.collate.vision = self.vision  # (packs with images: the vision tower's input, M-RoPE rows)
        self.objective = build_objective(self.cfg, self.choices.fused_loss.value, self.model)

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
        self.rollouts = Rollouts(*args) if self.objective.needs_generation else None  # (on-policy: grpo)

    def _setup_flops(self) -> None:
        """MFU in the step line: the model FLOPs of each step over the measured matmul peak of the run's devices."""
        cfg = self.cfg
        try:
            self.step_flops = StepFlops(self.model, cfg.adapter, cfg.lora_r, cfg.lora_target_modules)
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
        lora = self.cfg.adapter == "lora"
        state = load_checkpoint(
            path, self.engine, self.optimizer, self.scheduler, self.dist, trainable_only=lora, verified=True
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

    # -- steps -------------------------------------------------------------------------------------

    def _window(self) -> list[dict]:
        """The optimizer step's micro-batches, collated; the documents' lengths go to `self.window_lens`."""
        if self.rollouts is not None:  # the window's prompts as packs of sampled completions (grpo_rollouts.py)
            batches = self.rollouts.window(self.stream, self.cfg.gradient_accumulation_steps, self.step)
            self.window_lens = self.rollouts.lens
            return batches
        docs = [self.stream.next_docs() for _ in range(self.cfg.gradient_accumulation_steps)]
        self.window_lens = [len(e) for micro in docs for e in micro]
        return [self.collate(micro) for micro in docs]

    def train_step(self) -> dict:
        cfg = self.cfg
        d = self.dist
        batches = self._window()  # every rank collates the whole window: the token count needs no collective
        n_tokens = sum(b[NUM_LOSS_TOKENS] for b in batches)
        n_items = self.objective.window_items(batches)  # what the loss averages over: trained tokens, pairs
        # All of this rank's micro-batches go to the device up front, and the loss is summed there: the step
        # waits for the GPU once (loss and gradient norm together), not after every micro-batch.
        mine = [to_device(b, self.device) for b in distributed.my_share(d, batches)]
        losses = compose_step.backward(self.composed, mine, n_items, self.params, d)
        own = self.objective.step_metrics(d)  # (dpo's rewards/..., logps/...; a collective under torchrun)
        norm = compose_step.clip(self.params, cfg.max_grad_norm)
        # A stop request (signals.py) travels with the loss's all-reduce: every rank stops after the same step.
        loss_sum = torch.stack(losses).double().sum()
        summed = distributed.all_sum_(torch.stack([loss_sum, loss_sum.new_tensor(float(bool(self.stop.requested)))]), d)
        total, stop, grad_norm = torch.cat([summed, norm.double().to(summed.device).reshape(1)]).tolist()
        try:
            health.check_step(self.step + 1, total, grad_norm, cfg.learning_rate, self.model, d)
        except TrainingDiverged:
            self.optimizer.zero_grad(set_to_none=True)  # the update is never applied: the model stays finite
            raise
        lr = self.scheduler.get_last_lr()[0]
        with self.stop.hold():  # a second Ctrl-C never cuts an update in half
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.done_position = self.stream.position()
        flops = self.step_flops(self.window_lens) if self.step_flops else (0.0, 0.0)  # model, hardware
        return {
            "stop": stop > 0,
            "step": self.step,
            "loss": total,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": int(sum(b[NUM_TOKENS] for b in batches)),  # the documents' own, not filler
            "model_flops": flops[0],
            "hardware_flops": flops[1],
            "loss_tokens": n_tokens,
            "objective": own,
        }

    def first_step(self) -> dict:
        """This process's first step (of a fresh or a resumed run). Under `gradient_checkpointing: auto` with
        checkpointing left off, retried once with it on if it runs out of memory (runtime/oom.py)."""
        if self.cfg.gradient_checkpointing != "auto" or self.choices.checkpointing.value:
            return self.train_step()
        return oom.retry_with_checkpointing(
            self.train_step, self.model, self.optimizer, self.stream, self.device, self.dist
        )

    def _eval_examples(self) -> list[Example]:
        """The held-out examples every evaluation reads (the static layout is fitted over their packs too)."""
        return self.data.eval_examples[: self.cfg.eval_max_examples]

    def run_eval(self, result: TrainResult | None = None) -> dict | None:
        """Evaluate at this step, log it (and into `result.evals`); None without held-out examples."""
        ex, cfg = self._eval_examples(), self.cfg
        if not ex or (result is not None and result.evals and result.evals[-1]["step"] == self.step):
            return None  # (nothing held out, or this step's eval is done: a run at its last step or max_steps 0)
        res = evaluate(self.eval_model, ex, cfg.sequence_len, self.device, self.autocast, self.dist, self.collate)
        if cfg.eval_samples:  # greedy generations from held-out prompts (rank 0)
            res["samples"] = generate_samples(
                self.model, ex, self.tokenizer, cfg, self.device, self.autocast, self.dist
            )
        report_eval(res, self.step, self.metrics)
        if result is not None:
            result.evals.append(res)
        health.check_eval(self.step, res["eval_loss"], self.cfg.learning_rate, self.model, self.dist)
        return res

    def save(self) -> Path:
        """A checkpoint of the last completed step (once per step), which no second Ctrl-C cuts; refused when the
        weights are not finite (a diverged last update)."""
        path = self.out / f"checkpoint-{self.step}"
        if self.saved_step == self.step:
            return path
        with self.stop.hold():
            health.check_weights(self.step, self.params, self.dist, "saving a checkpoint", self.cfg.learning_rate)
            extra = {**base_identity(self.loaded), "run": self.run}
            ckpt.save_checkpoint(
                path, self.engine, self.optimizer, self.scheduler, self.step, self.done_position, extra, self.dist,
                trainable_only=self.cfg.adapter == "lora", tokenizer=self.tokenizer,
            )  # fmt: skip
            if self.dist.is_main:
                ckpt.prune_checkpoints(self.out, self.cfg.save_total_limit)
                plot_run(self.out)  # the curves so far (loss.png, ...: run/plots.py; a failure is one warning)
        self.saved_step = self.step
        return path

    def save_final(self) -> Path:
        """The final model (adapter or full) with tokenizer and model card, loadable by peft / transformers in the
        original class (run/export.py). Rank 0 writes it."""
        card = model_card(self.cfg, self.loaded, self.step, self.out) if self.dist.is_main else None
        masters_into_model(self.model, self.optimizer)  # the fp32 masters, not their bf16 copies, are exported
        return export.save_final(
            self.out, self.model, self.engine, self.tokenizer, self.dist, adapter=self.cfg.adapter, loaded=self.loaded,
            steps=self.step, card=card,
        )  # fmt: skip

    # -- the run -----------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        try:
            with self.stop.installed():
                return self._run()
        finally:
            self.close()

    def close(self) -> None:  # let go of the output directory's lock; the mixers' CUDA-graph settings undone
        self.lock = self.lock.release() if self.lock is not None else None
        if self.conv_before is not None:
            self.conv_before = cudagraphs.restore(self.conv_before)

    def _run(self) -> TrainResult:
        cfg = self.cfg
        result = TrainResult(steps=self.step, output_dir=str(self.out))
        self.run_eval(result)
        steps = StepLog(self.total_steps, self.step, cfg.logging_steps, self.peak_flops)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        first = True
        prof = ProfileWindow(cfg.profile_steps, self.total_steps, self.step, self.device, self.out, self.dist)
        try:
            while self.step < self.total_steps:
                prof.before(self.step + 1)
                rec = self.first_step() if first else self.train_step()  # this process's first (resumed too)
                first = False
                stop = rec.pop("stop")
                eval_due = bool(cfg.eval_steps) and self.step % cfg.eval_steps == 0 and self.step < self.total_steps
                save_due = bool(cfg.save_steps) and self.step % cfg.save_steps == 0 and self.step < self.total_steps
                steps.skip(prof.after(self.step, cut=eval_due or save_due or stop))  # (summaries are not training)
                steps.add(rec)
                result.losses.append(rec["loss"])  # the step's own (the logged one is the window's mean)
                if steps.due(self.step, stop):
                    # The peak over ranks (one scalar all-reduce, on logged steps only): ranks differ under FSDP2.
                    steps.log(rec, distributed.all_max(memory_gib(self.device), self.dist), self.metrics)
                    if self.cuda_graphs and (line := self.graph_log.changed()):
                        logger.info("%s", line)
                if self.on_log:
                    self.on_log(rec)
                if stop:
                    result.interrupted, result.signal = True, self.stop.requested
                    path = self.save()
                    why = self.stop.requested or "a signal on another rank"
                    logger.warning("stopped (%s): saved %s; continue with --resume_from_checkpoint latest", why, path)
                    break
                t = time.perf_counter()
                if eval_due:
                    self.run_eval(result)
                if save_due:
                    self.save()
                steps.skip(time.perf_counter() - t)  # tokens/s and MFU are the training steps' own
        except RewardError:  # a user's reward function failed (one line, exit 2): the steps done so far are kept
            logger.warning("stopped: saved %s", self.save()) if self.step > 0 else None
            raise
        except KeyboardInterrupt:
            # A second Ctrl-C: the step in flight is abandoned (its update was never applied, see signals.py).
            result.interrupted = True
            prof.cancel()  # not a window's profile, and not recording the save below
            self.optimizer.zero_grad(set_to_none=True)
            self.stream.seek(self.done_position)  # the abandoned step's batches come first on resume
            if self.dist.enabled:
                # Saving is a collective and the other ranks stopped at other points: the last complete
                # checkpoint is the one to continue from.
                logger.warning("interrupted: continue from the last checkpoint with --resume_from_checkpoint latest")
            else:
                path = self.save()
                logger.warning("interrupted: saved %s; continue with --resume_from_checkpoint latest", path)
        else:
            if not result.interrupted:
                self._finish(result)
        finally:
            prof.cancel()
            if self.metrics is not None:
                self.metrics.close()
                plot_run(self.out)  # the curves as the run ends: finished (its final eval too), stopped or failed
            if self.cuda_graphs:
                logger.info("%s", self.graph_log.final())
        result.steps = self.step
        return result

    def _finish(self, result: TrainResult) -> None:
        """The last step's checkpoint first (so nothing after it can lose the run), then the final eval, then the
        export. A stop asked for before the export leaves the checkpoint to finish from: a resume at the last step
        only evaluates and exports."""
        kept = True
        if self.step > 0:  # (max_steps 0: the starting model is evaluated and exported, without a checkpoint)
            try:
                self.save()
            except ckpt.DiskFullError as e:  # final/ is smaller than the resume state: never lose what was trained
                kept = False
                logger.warning("%s; writing final/ (the trained model) anyway: step %d cannot be resumed from, "
                               "but nothing trained is lost", str(e).split(";")[0], self.step)  # fmt: skip
        try:
            if not self.stop.requested:
                self.run_eval(result)
        except KeyboardInterrupt:
            pass  # a second Ctrl-C during the final eval
        if self.stop.requested and kept:
            result.interrupted, result.signal = True, self.stop.requested
            logger.warning(
                "stopped (%s) after the last step's checkpoint; --resume_from_checkpoint latest evaluates and exports",
                self.stop.requested,
            )
            return
        with self.stop.hold():  # (the weights were checked by the save above, or by the one that wrote them)
            result.final_dir = str(self.save_final())


def train(cfg: TrainConfig, on_log: Callable[[dict], None] | None = None) -> TrainResult:
    trainer = Trainer(cfg, on_log)
    trainer.setup()
    return trainer.train()
