"""The trainer: runs the steps of a run that setup.py (`TrainerSetup`: a table of contents) wired. Each part lives in its
own module:

    runtime/  choices.py (every `auto` resolved once, with its reason; memory.py its estimate), model.py, stream.py
              (data order and position), step.py (one micro-batch's loss; cudagraphs.py), distributed.py (DDP /
              FSDP2, the window split over ranks), profiling.py, oom.py (the first step's out-of-memory retry)
    run/      outdir.py (which runs a directory may hold), checkpoint.py (atomic DCP checkpoints, exact resume),
              export.py (the final model or adapter), plots.py (loss.png and the other curves)
    train/    setup.py, evaluation.py (held-out loss and exact match), objectives/ (each objective's spec: its loss,
              data, collator, rollouts; the trainer names none)

An optimizer step's loss is the mean over every trained token of its micro-batches (the window's token count is known
before the first forward), so k micro-batches equal one batch k times as large; under torchrun each rank runs its
share of the window with the same whole-window count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hybridtune.batch import NUM_LOSS_TOKENS, NUM_TOKENS
from hybridtune.config import TrainConfig
from hybridtune.errors import TrainingDiverged
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import export
from hybridtune.run.base import base_identity
from hybridtune.run.card import model_card
from hybridtune.run.plots import plot_run
from hybridtune.runtime import compose as compose_step
from hybridtune.runtime import distributed, health, oom
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.runtime.metrics import StepLog, memory_gib
from hybridtune.runtime.optim import masters_into_model
from hybridtune.runtime.profiling import ProfileWindow
from hybridtune.runtime.stream import to_device
from hybridtune.train.evaluation import evaluate, report_eval
from hybridtune.train.result import TrainResult  # (importable from here, as before)
from hybridtune.train.samples import generate_samples
from hybridtune.train.setup import TrainerSetup

logger = logging.getLogger(__name__)


class Trainer(TrainerSetup):
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
                trainable_only=adapter_kind(self.cfg).trainable_only, tokenizer=self.tokenizer,
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
            self.out, self.model, self.engine, self.tokenizer, self.dist, kind=adapter_kind(self.cfg),
            loaded=self.loaded, steps=self.step, card=card,
        )  # fmt: skip

    # -- the run -----------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        try:
            with self.stop.installed():
                return self._run()
        finally:
            self.close()

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
        except self.spec.keeps_steps:  # its user code failed (grpo's rewards; exit 2): the steps done are kept
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
