"""The training loop: packed batches, LoRA or full fine-tune, AdamW with warmup + decay, gradient
accumulation, clipping, eval on a held-out split, atomic checkpoints and exact resume.

The loss of an optimizer step is the mean over every trained token of all its micro-batches (the
token count of the whole accumulation window is known before the first forward), so accumulation
over k micro-batches equals one batch k times as large.

Under torchrun the same window is split over the ranks (`train/distributed.py`): each rank runs its
share of the micro-batches with the same whole-window token count, the engine sums the gradients, and
the loss, the schedule and the global batch are those of one process.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridtune.config import TrainConfig, compile_overrides, to_dict
from hybridtune.data import IGNORE_INDEX, PackedCollator
from hybridtune.data.build import PreparedData, prepare
from hybridtune.data.collator import StaticLayout
from hybridtune.data.packing import Example
from hybridtune.errors import ConfigError, OutputDirError
from hybridtune.train import checkpoint as ckpt
from hybridtune.train import distributed
from hybridtune.train.metrics import MetricsLog, Throughput, format_step, memory_gib
from hybridtune.train.profiling import StepProfiler, summary_line
from hybridtune.train.step import fused_loss_blocker, router_loss

logger = logging.getLogger(__name__)
# Estimated share of the step the filler costs (`FillerShares.cost`: tokens, and GDN chunks weighted by
# their kernels' share) above which `pack_layout: auto` stays dynamic (the static graph's compile-time and
# CUDA-graph gains are not worth more compute per step), and the cap for an explicit `static`.
AUTO_MAX_FILLER = 0.10
STATIC_MAX_FILLER = 0.50

RUN_FILE = "hybridtune_run.json"
PROFILE_FILE = "profile-{first}-{last}.json"
SMALL_MODEL_PARAMS = 50_000_000
# Keys that do not change what a run computes: a run may continue or resume under other values.
NON_IDENTITY_KEYS = (
    "overwrite",
    "resume_from_checkpoint",
    "max_steps",
    "eval_steps",
    "save_steps",
    "logging_steps",
    "profile_steps",
    "num_threads",
    "distributed",
    "fsdp_units",
)


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # loss of every optimizer step run in this process
    evals: list[dict] = field(default_factory=list)
    output_dir: str = ""
    final_dir: str | None = None
    interrupted: bool = False


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for but no CUDA GPU is visible; use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        progress = min(max(progress, 0.0), 1.0)
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def identity(config: dict) -> dict:
    """What a run computes: its config (as a dict) without the keys that do not change it."""
    return {k: v for k, v in config.items() if k not in NON_IDENTITY_KEYS}


def check_output_dir(cfg: TrainConfig) -> bool:
    """Refuse an output_dir that holds a different run. Returns True when metrics should start fresh."""
    out = Path(cfg.output_dir)
    if cfg.resume_from_checkpoint:
        return False
    if not out.exists() or not any(out.iterdir()):
        return True
    run_file = out / RUN_FILE
    if run_file.is_file():
        try:
            held = json.loads(run_file.read_text()).get("config", {})
        except json.JSONDecodeError:
            held = None
        if held is not None and identity(held) == identity(to_dict(cfg)):
            if not cfg.overwrite:
                ckpt.check_restart(out)  # an unfinished run's checkpoints: resume it, or --overwrite
            logger.info("output_dir %s holds an earlier run of the same config; starting it again", out)
            return True
    if cfg.overwrite:
        logger.warning("output_dir %s holds another run; --overwrite given, its files will be replaced", out)
        return True
    what = "another hybridtune run" if run_file.is_file() else "files that are not from this run"
    raise OutputDirError(
        f"output_dir '{out}' already holds {what}; choose another --output_dir, resume with "
        f"--resume_from_checkpoint latest, or pass --overwrite"
    )


def claim_output_dir(cfg: TrainConfig) -> bool:
    """`check_output_dir`, then remove what earlier processes left there that would mislead this run (rank 0)."""
    fresh = check_output_dir(cfg)
    done = ckpt.tidy_output_dir(Path(cfg.output_dir), fresh, cfg.resume_from_checkpoint, cfg.overwrite)
    if done:
        logger.info("%s", done)
    return fresh


class BatchStream:
    """Deterministic stream of micro-batches over epochs; its position is saved in checkpoints.

    Epoch e visits the bins in a permutation seeded by (seed, e); a micro-batch is `micro_batch_size`
    consecutive bins of that order laid end to end.
    """

    def __init__(self, bins: list[list[Example]], micro_batch_size: int, seed: int):
        self.bins, self.mbs, self.seed = bins, micro_batch_size, seed
        self.epoch, self.index = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> list[int]:
        order = list(range(len(self.bins)))
        random.Random(self.seed * 1000003 + epoch).shuffle(order)
        return order

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, pos: dict) -> None:
        self.epoch, self.index = pos["epoch"], pos["index"]
        self._order = self._perm(self.epoch)

    def next_docs(self) -> list[Example]:
        docs: list[Example] = []
        for _ in range(self.mbs):
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._perm(self.epoch)
            docs.extend(self.bins[self._order[self.index]])
            self.index += 1
        return docs

    def micro_batches_per_epoch(self) -> int:
        return math.ceil(len(self.bins) / self.mbs)


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device`. For a GPU they are pinned first: a copy from pageable host memory waits
    for the stream to drain, one from pinned memory is queued behind the work already launched."""
    pin = device.type == "cuda"
    return {
        k: (
            (v.pin_memory() if pin and v.device.type == "cpu" else v).to(device, non_blocking=True)
            if torch.is_tensor(v)
            else v
        )
        for k, v in batch.items()
    }


def eval_batches(examples: list[Example], seq_len: int) -> Iterator[list[Example]]:
    """Held-out examples in packs of at most seq_len tokens, in order."""
    cur: list[Example] = []
    used = 0
    for ex in examples:
        if cur and used + len(ex) > seq_len:
            yield cur
            cur, used = [], 0
        cur.append(ex)
        used += len(ex)
    if cur:
        yield cur


@torch.no_grad()
def evaluate(
    model,
    examples: list[Example],
    seq_len: int,
    device: torch.device,
    autocast,
    d: distributed.Dist = distributed.ONE,
    collate: PackedCollator | None = None,
) -> dict:
    """Held-out loss and exact match. `model(batch)` returns the logits `[1, T, vocab]` (a `LossModule`).

    Under torchrun each rank evaluates its share of the packs (`distributed.eval_share`) and the sums are
    all-reduced: every rank returns the metrics of one process, up to the order of float64 sums.

    Exact match: an example counts when the argmax prediction at every trained position (the whole
    response, end-of-turn included) equals the target. Under teacher forcing this is exactly the
    condition for greedy decoding to reproduce the response, so it is computed in one packed forward.
    """
    was_training = model.training
    model.eval()
    collate = collate or PackedCollator()
    total_loss, total_tokens, correct, counted = 0.0, 0, 0, 0
    packs = list(eval_batches(examples, seq_len))
    for i, counts in distributed.eval_share(len(packs), d):
        batch = to_device(collate(packs[i]), device)
        with autocast():
            logits = model(batch)
        if not counts:
            continue  # FSDP2: a rank short of packs takes part in the forward's collectives, counting nothing
        n = batch["num_tokens"]  # the documents' own tokens: a static layout's filler comes after them
        logits = logits[0, : n - 1].float()
        targets = batch["labels"][0, 1:n]
        mask = targets != IGNORE_INDEX
        ce = torch.nn.functional.cross_entropy(logits, targets.clamp(min=0), reduction="none")
        total_loss += float(ce[mask].sum())
        total_tokens += int(mask.sum())
        ok = (logits.argmax(-1) == targets) | ~mask
        cu = batch["cu_seq_lens_q"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            # positions a..b-2 predict tokens a+1..b-1 of this document
            if mask[a : b - 1].any():
                counted += 1
                correct += int(ok[a : b - 1].all())
    model.train(was_training)
    total_loss, total_tokens, correct, counted = distributed.all_sum([total_loss, total_tokens, correct, counted], d)
    counted = int(counted)  # float64 holds these counts exactly
    return {
        "eval_loss": total_loss / max(total_tokens, 1),
        "exact_match": correct / max(counted, 1),
        "eval_examples": counted,
    }


class Trainer:
    def __init__(self, cfg: TrainConfig, on_log: Callable[[dict], None] | None = None):
        self.cfg = cfg
        self.on_log = on_log
        # Before pick_device: under torchrun on CUDA this selects the rank's GPU.
        self.dist = distributed.init(cfg.distributed, cfg.adapter, cfg.device)
        self.device = pick_device(cfg.device)
        self.out = Path(cfg.output_dir)

    # -- setup -------------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        d = self.dist
        distributed.check_window(d, cfg.gradient_accumulation_steps)
        fresh_metrics = distributed.main_only(d, lambda: claim_output_dir(cfg))
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)

        from hybridtune.kernels.provision import prepare as prepare_kernels
        from hybridtune.models.loading import load_model, tokenizer_for
        from hybridtune.models.patching import patch_model

        # Data before the model: bad input fails in a second, not after a model load.
        self.tokenizer = tokenizer_for(cfg.base_model, cfg.tokenizer)
        self.data: PreparedData = prepare(cfg, self.tokenizer)
        # Kernels are provisioned and verified before anything imports the modeling module, which is
        # where transformers picks its fast or slow path.
        self.kernel_report = prepare_kernels(cfg.kernels, cfg.require_fast_path, cfg.base_model)
        use_bf16 = cfg.bf16 is True or (
            cfg.bf16 == "auto" and self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        )
        # LoRA trains adapters only: the frozen base is held in bf16 (half the memory, no per-step casts of
        # its weights under autocast); peft keeps the adapters in fp32. A full fine-tune keeps fp32 masters.
        base_dtype = torch.bfloat16 if use_bf16 and cfg.adapter == "lora" else None
        loaded = load_model(cfg.base_model, self.tokenizer, seed=cfg.seed, dtype=base_dtype)
        self.loaded = loaded

        model = loaded.model
        self._choose_threads(model)
        self.patch_report = patch_model(model)
        logger.info("%s", self.patch_report)
        if cfg.gradient_checkpointing is True:
            enable_checkpointing(model)
        if cfg.adapter == "lora":
            from hybridtune.train.lora import apply_lora

            model = apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
        model.to(self.device)
        model.train()
        self.model = model
        self.use_bf16 = use_bf16
        self.strategy = self._strategy(model)
        if d.engine == "fsdp":
            units = distributed.fsdp_units(cfg.fsdp_units, self.strategy)
            self.dist = d = dataclasses.replace(d, units=units)
        self.collate = self._collator(self.strategy, model)
        self.compile_handle = self._compile(model)
        self.fused_loss = self._choose_loss(model)
        # What steps and saves: the model itself in one process, DDP- or FSDP2-wrapped under torchrun (the
        # compiled loop is one graph over all layers, so FSDP2's unit is the whole model under it: `fsdp_units`).
        self.engine = distributed.wrap(distributed.LossModule(model), d, self.device, use_bf16)
        # Eval runs the forward alone: DDP's copy needs no engine; FSDP2's shards must gather (all ranks).
        self.eval_model = self.engine.module if d.engine == "ddp" else self.engine

        params = [p for p in self.engine.parameters() if p.requires_grad]
        self.params = params
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=fused)
        self.stream = BatchStream(self.data.bins, cfg.micro_batch_size, cfg.seed)
        per_epoch = math.ceil(self.stream.micro_batches_per_epoch() / cfg.gradient_accumulation_steps)
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(per_epoch * cfg.num_epochs))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_scheduler, cfg.warmup_steps, self.total_steps)
        )
        self.step = 0
        if d.enabled:
            # Dropout differs per rank (the model init above was the same everywhere: FSDP2 does not broadcast).
            # A resumed run then restores each rank's own RNG state.
            torch.manual_seed(cfg.seed + d.rank)
        if cfg.resume_from_checkpoint:
            self._resume(cfg.resume_from_checkpoint)
        if cfg.bf16 is True and self.device.type == "cpu":
            logger.warning("bf16 on CPU autocasts matmuls only and is slow on most CPUs; fp32 is the CPU default")
        self.autocast = lambda: torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)
        if d.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self._write_run_file()
        self.metrics = MetricsLog(self.out / "metrics.jsonl", truncate=fresh_metrics) if d.is_main else None
        logger.info(
            "training %s (%s) on %s%s: %d steps, %d bins/step of %d tokens, lr %.1e %s",
            loaded.name,
            cfg.adapter,
            self.device,
            f" x {d.world} processes ({d.engine})" if d.enabled else "",
            self.total_steps,
            cfg.micro_batch_size * cfg.gradient_accumulation_steps,
            cfg.sequence_len,
            cfg.learning_rate,
            cfg.lr_scheduler,
        )

    def _choose_threads(self, model) -> None:
        """On CPU, a tiny model's ops are too small to split: extra threads only add synchronisation.

        Measured on a 2-core machine (tiny-qwen3_5, 256-token step): 0.15 s with 1 thread, 0.2 to 5.7 s
        with 2 (the spread is other load: OpenMP threads spin-wait for a busy core).
        """
        if self.cfg.num_threads or self.device.type != "cpu":
            return
        n_params = sum(p.numel() for p in model.parameters())
        if n_params < SMALL_MODEL_PARAMS:
            torch.set_num_threads(1)
            logger.info("CPU: 1 thread for a %.1fM-parameter model (set num_threads to override)", n_params / 1e6)

    def _choose_loss(self, model) -> bool:
        blocker = fused_loss_blocker(model)
        if self.cfg.loss == "plain":
            return False
        if blocker is None:
            logger.info("loss: fused chunked cross-entropy against lm_head (no [tokens, vocab] logits kept)")
            return True
        if self.cfg.loss == "fused":
            raise ConfigError(f"loss 'fused' cannot stand in for this model's loss: {blocker}; use loss: auto or plain")
        logger.warning("loss: transformers' own ([tokens, vocab] logits kept): %s", blocker)
        return False

    def _strategy(self, model) -> str:
        """`compile: auto` is the loop on a GPU and off on the CPU. The loop's one graph cannot hold FSDP2's
        per-layer hooks nor record an MoE router loss's logits: for those, auto is the per-class `modules`, and
        an explicit `loop` with a router loss is refused."""
        cfg = self.cfg
        why = "the model adds a router loss (output_router_logits)" if router_loss(model) else None
        if cfg.compile == "loop" and why:
            raise ConfigError(
                f"compile 'loop': {why}, whose router logits the one-graph loop cannot record; "
                "use compile: modules (or auto)"
            )
        per_layer = self.dist.engine == "fsdp" and cfg.fsdp_units == "layer"
        too_big = self._whole_model_too_big(model)
        if too_big and cfg.compile == "loop":
            logger.warning("%s; compile: loop keeps it one unit (fsdp_units: layer would shard per layer)", too_big)
        elif too_big:
            per_layer, why = True, why or too_big
        if cfg.compile == "loop" and per_layer:
            raise ConfigError(
                "config keys 'fsdp_units' = 'layer' and 'compile' = 'loop' do not go together: the loop is one graph "
                "over every layer and FSDP2's per-layer hooks cannot run inside it; use compile: modules (or auto), "
                "or fsdp_units: model"
            )
        if cfg.compile != "auto":
            return cfg.compile
        if self.device.type != "cuda":
            return "off"
        if per_layer:
            why = why or "FSDP2 shards per decoder layer (fsdp_units: layer)"
        if why:
            logger.info("compile: auto -> modules (per-class forwards): %s, which the one-graph loop cannot hold", why)
            return "modules"
        return "loop"

    def _whole_model_too_big(self, model) -> str | None:
        """Under FSDP2 with `fsdp_units: auto` on a GPU: why the whole model as one unit would not leave room for
        activations (the units are then per layer, and the compile per class), or None."""
        d = self.dist
        if d.engine != "fsdp" or self.cfg.fsdp_units != "auto" or self.device.type != "cuda":
            return None
        need = distributed.whole_model_bytes(model, d.world, self.use_bf16)
        have = torch.cuda.get_device_properties(self.device).total_memory
        # Every rank must choose the same units and compile: the tightest GPU decides.
        share = distributed.all_max(need / have, d)
        if share <= distributed.WHOLE_MODEL_SHARE:
            return None
        return (
            f"the whole model as one FSDP2 unit needs about {need / 2**30:.0f} GiB per GPU before activations, "
            f"{share:.0%} of the smallest GPU, more than {distributed.WHOLE_MODEL_SHARE:.0%} (fsdp_units: auto -> layer)"
        )

    def _compile(self, model):
        """Compile after patching, LoRA and checkpointing are in place (the graph must see all three)."""
        strategy = self.strategy
        if strategy == "off":
            return None
        from hybridtune.compiler.strategies import compile_model

        opts = (
            {"overrides": compile_overrides(self.cfg)} if strategy == "modules" and self.cfg.compile_overrides else {}
        )
        if strategy == "loop":
            opts["static_shapes"] = self.collate.layout is not None
        handle = compile_model(model, strategy, **opts)
        logger.info("compile: strategy '%s' (the first step includes compilation)", strategy)
        return handle

    def _write_run_file(self) -> None:
        data = {"config": to_dict(self.cfg), "hybridtune_version": __import__("hybridtune").__version__}
        ckpt.atomic_write_text(self.out / RUN_FILE, json.dumps(data, indent=2))

    def _resume(self, where: str) -> None:
        path = Path(where)
        if where == "latest":
            found = ckpt.list_checkpoints(self.out)
            if not found:
                raise ConfigError(f"resume_from_checkpoint 'latest': no checkpoint in '{self.out}'")
            path = found[-1]
        if not (path / ckpt.META_FILE).is_file():
            raise ConfigError(f"resume_from_checkpoint '{where}' is not a complete hybridtune checkpoint directory")
        state = ckpt.load_checkpoint(
            path, self.engine, self.optimizer, self.scheduler, self.dist, trainable_only=self.cfg.adapter == "lora"
        )
        self.stream.seek(state["data_position"])
        self.step = state["step"]
        written = f" (written by {state['world']} process(es))" if state.get("world", 1) != self.dist.world else ""
        logger.info("resumed from %s at step %d%s", path, self.step, written)

    # -- steps -------------------------------------------------------------------------------------

    def _window(self) -> list[dict]:
        return [self.collate(self.stream.next_docs()) for _ in range(self.cfg.gradient_accumulation_steps)]

    def _collator(self, strategy: str, model) -> PackedCollator:
        """The batch layout. Static (every batch filled to one size fitted over every train and eval pack this
        run collates) under `pack_layout: static`, or `auto` under a compile (the loop, or the per-class forwards,
        which then compile once per class, not once more after the first change of sizes) when the fit costs at most
        AUTO_MAX_FILLER of the computed tokens; dynamic otherwise (said in one line). Never static for a model
        with a router loss: the filler's tokens would count in its load-balancing statistics."""
        cfg = self.cfg
        router = router_loss(model)
        if cfg.pack_layout == "static" and router:
            raise ConfigError(
                "pack_layout 'static': the model adds a router loss (output_router_logits), and the filler "
                "documents' tokens would count in its load-balancing loss; use pack_layout: dynamic (or auto)"
            )
        if cfg.pack_layout == "dynamic" or (cfg.pack_layout == "auto" and strategy not in ("loop", "modules")):
            return PackedCollator()
        if cfg.pack_layout == "auto" and router:
            logger.info("pack layout: dynamic (the model's router loss would count the filler documents' tokens)")
            return PackedCollator()
        if cfg.micro_batch_size > 1:
            if cfg.pack_layout == "static":
                raise ConfigError(
                    "pack_layout 'static' needs micro_batch_size 1 (a micro-batch of several bins is collated as "
                    "one pack); raise gradient_accumulation_steps instead, or use pack_layout: dynamic"
                )
            logger.info("pack layout: dynamic (micro_batch_size > 1; the static layout fits single bins)")
            return PackedCollator()
        packs = [[len(e) for e in b] for b in self.data.bins]
        packs += [[len(e) for e in b] for b in eval_batches(self._eval_examples(), cfg.sequence_len)]
        limit = AUTO_MAX_FILLER if cfg.pack_layout == "auto" else STATIC_MAX_FILLER
        layout = StaticLayout.fit(packs, max_filler=limit)
        if layout is None:
            why = f"the filler of any static layout for these packs would cost more than {limit:.0%} of the step"
            if cfg.pack_layout == "static":
                raise ConfigError(f"pack_layout 'static': {why}; use pack_layout: dynamic (or auto)")
            logger.info("pack layout: dynamic (%s)", why)
            return PackedCollator()
        shares = layout.filler_shares(packs)
        logger.info(
            "pack layout: static, every batch %d tokens in %d documents (filler: %.1f%% of the tokens, %.1f%% of the "
            "GDN chunks, about %.1f%% of the step)",
            layout.tokens,
            layout.docs,
            100 * shares.tokens,
            100 * shares.chunks,
            100 * shares.cost,
        )
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return PackedCollator(layout=layout, pad_token_id=pad)

    def train_step(self) -> dict:
        cfg = self.cfg
        d = self.dist
        batches = self._window()  # every rank collates the whole window: the token count needs no collective
        n_tokens = sum(b["num_loss_tokens"] for b in batches)
        # All of this rank's micro-batches go to the device up front, and the loss is summed there: the step
        # waits for the GPU once (loss and gradient norm together), not after every micro-batch.
        mine = [to_device(b, self.device) for b in distributed.my_share(d, batches)]
        losses = []
        for i, b in enumerate(mine):
            with distributed.accumulation(self.engine, d, last=i == len(mine) - 1):
                with self.autocast():
                    loss = self.engine(b, n_tokens, self.fused_loss)
                # DDP and FSDP2 average over ranks; times N, that average is the sum the window's loss needs.
                (loss * d.world if d.enabled else loss).backward()
            losses.append(loss.detach().float())
        norm = distributed.total_grad_norm(self.params)
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, cfg.max_grad_norm, norm)
        loss_sum = distributed.all_sum_(torch.stack(losses).double().sum(), d)
        total, grad_norm = torch.stack([loss_sum, norm.double().to(loss_sum.device)]).tolist()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {
            "step": self.step,
            "loss": total,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": int(sum(b["num_tokens"] for b in batches)),  # the documents' own, not filler
            "loss_tokens": n_tokens,
        }

    def save(self) -> Path:
        path = ckpt.save_checkpoint(
            self.out / f"checkpoint-{self.step}",
            self.engine,
            self.optimizer,
            self.scheduler,
            self.step,
            self.stream.position(),
            {"base_model": self.loaded.name},
            self.dist,
            trainable_only=self.cfg.adapter == "lora",
        )
        if self.dist.is_main:
            ckpt.prune_checkpoints(self.out, self.cfg.save_total_limit)
        return path

    def _eval_examples(self) -> list[Example]:
        """The held-out examples every evaluation reads (the static layout is fitted over their packs too)."""
        return self.data.eval_examples[: self.cfg.eval_max_examples]

    def run_eval(self) -> dict | None:
        if not self.data.eval_examples:
            return None
        ex = self._eval_examples()
        res = evaluate(self.eval_model, ex, self.cfg.sequence_len, self.device, self.autocast, self.dist, self.collate)
        res["step"] = self.step
        if self.metrics is not None:
            self.metrics.write({"type": "eval", **res})
        logger.info(
            "eval  step %d  eval_loss %.4f  exact_match %.3f (%d held-out examples)",
            self.step,
            res["eval_loss"],
            res["exact_match"],
            res["eval_examples"],
        )
        return res

    def first_step(self) -> dict:
        """This process's first step (of a fresh or a resumed run). Under `gradient_checkpointing: auto`, one
        retry with checkpointing on if it ran out of memory without it (one process only: under torchrun the
        other ranks are already inside collectives, so there the error says which setting to change)."""
        if self.cfg.gradient_checkpointing != "auto":
            return self.train_step()
        pos = self.stream.position()
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        try:
            return self.train_step()
        except torch.OutOfMemoryError as e:
            if self.dist.enabled:
                also = " or fsdp_units: layer" if self.dist.engine == "fsdp" and self.dist.units == "model" else ""
                raise ConfigError(
                    f"out of GPU memory in the first step without gradient checkpointing ({str(e).splitlines()[0]}); "
                    f"set gradient_checkpointing: true (or a shorter sequence_len{also})"
                ) from None
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()  # the failed step's traceback frames may still hold activations
        torch.set_rng_state(rng[0])  # dropout draws as in a run that had checkpointing from the start
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(rng[1], self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)  # the logged peak is the run's, not the failed try's
        self.stream.seek(pos)
        enable_checkpointing(self.model)
        logger.warning(
            "gradient_checkpointing auto: the first step ran out of GPU memory without checkpointing; "
            "switched it on and retried the step (set gradient_checkpointing: true to start that way)"
        )
        return self.train_step()

    def train(self) -> TrainResult:
        cfg = self.cfg
        result = TrainResult(steps=self.step, output_dir=str(self.out))
        ev = self.run_eval()
        if ev:
            result.evals.append(ev)
        tput = Throughput()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        first = True
        window = profile_window(cfg.profile_steps, self.total_steps, self.step)
        profiler = None
        try:
            while self.step < self.total_steps:
                if window and self.step + 1 == window[0]:
                    profiler = StepProfiler(self.device)
                    profiler.start()
                rec = self.first_step() if first else self.train_step()  # this process's first (resumed too)
                first = False
                eval_due = bool(cfg.eval_steps) and self.step % cfg.eval_steps == 0 and self.step < self.total_steps
                save_due = bool(cfg.save_steps) and self.step % cfg.save_steps == 0 and self.step < self.total_steps
                if profiler is not None and (self.step == window[1] or eval_due or save_due):
                    # The window ends early rather than profile an evaluation or a checkpoint (same step on every
                    # rank); summarising and gathering are left out of the logged tokens/s.
                    t = time.perf_counter()
                    self._write_profile(profiler, window[0], self.step)
                    profiler = None
                    tput.skip(time.perf_counter() - t)
                tput.add(rec["tokens"])
                result.losses.append(rec["loss"])
                if self.step % cfg.logging_steps == 0 or self.step == self.total_steps or self.step == 1:
                    # The peak over ranks (one scalar all-reduce, on logged steps only): ranks differ under FSDP2.
                    mem = distributed.all_max(memory_gib(self.device), self.dist)
                    rec.update(tokens_per_s=tput.take(), mem_gib=mem, type="train")
                    if self.metrics is not None:
                        self.metrics.write(rec)
                    logger.info("%s", format_step(rec))
                if self.on_log:
                    self.on_log(rec)
                if eval_due:
                    ev = self.run_eval()
                    if ev:
                        result.evals.append(ev)
                if save_due:
                    self.save()
        except KeyboardInterrupt:
            result.interrupted = True
            if profiler is not None:
                profiler.cancel()  # not a window's profile, and not recording the save below
                profiler = None
            if self.dist.enabled:
                # Saving is a collective and the other ranks stopped at other points: the last complete
                # checkpoint is the one to continue from (torchrun ends every rank on Ctrl-C).
                logger.warning("interrupted: continue from the last checkpoint with --resume_from_checkpoint latest")
            else:
                # The step in flight is dropped (its gradients were never applied); the checkpoint holds the
                # state after the last complete step, and its data position points at the dropped batch.
                path = self.save()
                logger.warning("interrupted: saved %s; continue with --resume_from_checkpoint latest", path)
        else:
            ev = self.run_eval()
            if ev:
                result.evals.append(ev)
            self.save()
            result.final_dir = str(self.save_final())
        finally:
            if profiler is not None:
                profiler.cancel()
            if self.metrics is not None:
                self.metrics.close()
        result.steps = self.step
        return result

    def _write_profile(self, profiler: StepProfiler, first: int, last: int) -> None:
        """Every rank's profile of steps first..last into profile-<first>-<last>.json (rank 0 writes; a resumed
        run's profile does not replace an earlier one); rank 0's summary in the log. A rank whose summary
        failed sends its error instead, so no rank waits in the gather for it; profiling never ends the run."""
        try:
            summary = profiler.stop(last - first + 1)
        except Exception as e:
            summary = {"error": f"{type(e).__name__}: {e}"}
        ranks = distributed.gather_objects(summary, self.dist)
        if not self.dist.is_main:
            return
        path = self.out / PROFILE_FILE.format(first=first, last=last)
        doc = {"steps": [first, last], "world": self.dist.world, "ranks": ranks}
        ckpt.atomic_write_text(path, json.dumps(doc, indent=2))
        failed = [f"rank {r}: {p['error']}" for r, p in enumerate(ranks) if "error" in p]
        if failed:
            logger.warning("profile of steps %d-%d failed on %s; %s", first, last, "; ".join(failed), path)
        else:
            logger.info(
                "profile of steps %d-%d (rank 0): %s; all ranks in %s", first, last, summary_line(summary), path
            )

    def _gathered_state(self) -> dict | None:
        """Under FSDP2: the whole model's state dict on rank 0, on the CPU (a collective; empty on other
        ranks). Otherwise None: the model in memory is whole."""
        if self.dist.engine != "fsdp":
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.engine, options=opts)
        # Tied weights (lm_head = embed_tokens) come back as two tensors; keep the first name, as the model's
        # own state_dict + save_pretrained would.
        seen, tied = set(), set()
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                tied.add(name)
            seen.add(id(p))
        state = {k.removeprefix("model."): v for k, v in state.items()}  # LossModule's prefix
        return {k: v for k, v in state.items() if k not in tied}

    def save_final(self) -> Path:
        """The final model (adapter or full) with tokenizer, loadable by peft / transformers. Rank 0 writes it."""
        full = self._gathered_state()
        if not self.dist.is_main:
            distributed.barrier(self.dist)
            return self.out / "final"
        base_dir = None
        if self.cfg.adapter == "lora" and self.loaded.source == "preset":
            # A preset's base weights exist only in memory: save them so the adapter can be loaded and merged.
            base_dir = self.out / "base_model"
            base = self.model.get_base_model()

            def write_base(tmp: Path) -> None:
                _save_unwrapped_base(base, tmp, full)
                self.tokenizer.save_pretrained(tmp)

            ckpt.atomic_dir(base_dir, write_base)

        def write(tmp: Path) -> None:
            if base_dir is not None:
                self.model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
            kw = {"state_dict": full} if full is not None else {}
            self.model.save_pretrained(tmp, safe_serialization=True, **kw)
            self.tokenizer.save_pretrained(tmp)
            (tmp / "hybridtune.json").write_text(
                json.dumps({"base_model": self.loaded.name, "adapter": self.cfg.adapter, "steps": self.step}, indent=2)
            )

        final = ckpt.atomic_dir(self.out / "final", write)
        logger.info("saved final %s to %s", "adapter" if self.cfg.adapter == "lora" else "model", final)
        distributed.barrier(self.dist)
        return final


def _save_unwrapped_base(base, tmp: Path, peft_state: dict | None = None) -> None:
    """Save the frozen base weights without LoRA layers: peft keeps the original Linear as `base_layer`.

    `peft_state`: the gathered state dict of the whole peft model (FSDP2), in place of `base`'s own.
    """
    prefix = "base_model.model."
    if peft_state is None:
        items = base.state_dict().items()
    else:
        items = ((k.removeprefix(prefix), v) for k, v in peft_state.items() if k.startswith(prefix))
    state = {}
    for name, tensor in items:
        if "lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = tensor
    base.save_pretrained(tmp, state_dict=state, safe_serialization=True)


def profile_window(n: int, total_steps: int, done: int) -> tuple[int, int] | None:
    """The steps `profile_steps: n` profiles, first and last: from step 11 (past compilation and the first
    shapes' recompiles), or the last n of a shorter run, never this process's first step (`done` steps were
    done before it: a resumed run); None when n is 0. A run too short for all n profiles fewer, with a warning.

    >>> profile_window(3, 100, 0), profile_window(3, 8, 0), profile_window(3, 100, 50), profile_window(3, 1, 0)
    ((11, 13), (6, 8), (52, 54), None)
    """
    if n <= 0:
        return None
    first = max(done + 2, min(11, total_steps - n + 1))
    last = min(first + n - 1, total_steps)
    if last - first + 1 < n:
        if first > last:
            logger.warning(
                "profile_steps %d: no step to profile (%d steps, the first compiles); skipped", n, total_steps
            )
            return None
        logger.warning("profile_steps %d: the run has room for %d (steps %d-%d)", n, last - first + 1, first, last)
    return first, last


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing on every decoder layer (peft-wrapped or not); non-reentrant
    needs no `enable_input_require_grads` hook for frozen embeddings, and traces under the compiled loop."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def train(cfg: TrainConfig, on_log: Callable[[dict], None] | None = None) -> TrainResult:
    trainer = Trainer(cfg, on_log)
    trainer.setup()
    return trainer.train()
