"""Per-step metrics: throughput, memory, the logged step's record and line, and the metrics.jsonl log."""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path

import torch

from hybridtune.compiler import recompute
from hybridtune.errors import OutputDirError
from hybridtune.files import atomic_write_text
from hybridtune.models.anatomy import text_config
from hybridtune.models.flops import step_flops
from hybridtune.runtime.adapter_kind import AdapterKind
from hybridtune.runtime.lora import applied_targets

logger = logging.getLogger(__name__)

# A step record's objective metrics (`Objective.step_metrics`: dpo's rewards/chosen, ...): `StepLog` averages them
# over the logged steps and writes them into the record under their own names.
OBJECTIVE = "objective"


def memory_gib(device: torch.device) -> float:
    """Peak allocated GiB on a CUDA device since the last reset; resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        # ru_maxrss is KiB on Linux.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    except ImportError:  # not on Linux/macOS
        return float("nan")


class Throughput:
    """Tokens and model FLOPs per second over the window since the last `take()`; MFU against `peak_flops` (the
    measured dense-matmul FLOP/s of every GPU of the run together), when known, and HFU (the hardware FLOPs:
    gradient checkpointing's recompute included)."""

    def __init__(self, peak_flops: float | None = None) -> None:
        self.peak = peak_flops
        self.t0 = time.perf_counter()
        self.tokens = self.steps = 0
        self.flops = self.hardware = 0.0

    def add(self, n: int, flops: float = 0.0, hardware: float | None = None) -> None:
        self.tokens += n
        self.steps += 1
        self.flops += flops
        self.hardware += flops if hardware is None else hardware

    def skip(self, seconds: float) -> None:
        """Leave `seconds` (spent on something other than training: an eval, a save, a profile's summary) out of
        the window."""
        self.t0 += seconds

    def take(self) -> dict:
        now = time.perf_counter()
        dt = max(now - self.t0, 1e-9)
        out = {"tokens_per_s": self.tokens / dt}
        if self.steps:
            out["step_s"] = dt / self.steps  # wall seconds per step of the window (an on-policy step's generation too)
        if self.flops:
            out["tflops"] = self.flops / dt / 1e12
            if self.peak:
                out["mfu"] = self.flops / dt / self.peak
                out["hfu"] = self.hardware / dt / self.peak
        self.t0, self.tokens, self.steps, self.flops, self.hardware = now, 0, 0, 0.0, 0.0
        return out


class StepFlops:
    """Model FLOPs of a step (no recompute: what MFU counts) and hardware FLOPs (with gradient checkpointing's
    recompute, as the model stands at the call: the out-of-memory retry may switch it on) from its documents'
    lengths, for the model's family."""

    def __init__(self, model: torch.nn.Module, kind: AdapterKind, lora_r: int, lora_targets: list[str]):
        """For a peft model the LoRA charged is what peft applied (`lora.applied_targets`: the modules it wrapped and
        the routed experts' parameters), not the configured names, which may match nothing or be rewritten."""
        self.config, self.model = text_config(model), model
        params: list[str] = []
        if kind.lora and hasattr(getattr(model, "base_model", None), "targeted_module_names"):
            lora_targets, params = applied_targets(model)
        self.kw = {
            "adapter": kind.adapter,
            "lora_r": lora_r if kind.lora else 0,
            "lora_targets": lora_targets,
            "lora_parameters": params,
        }
        # The modules that can checkpoint (transformers' switch sets the flag only where the class has one), found
        # once: each step then reads their flags, not the whole module tree.
        self.switches = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self([1])  # a model the count does not know fails here, once, not at every step

    def __call__(self, doc_lens) -> tuple[float, float]:
        """(model FLOPs, hardware FLOPs) of a step over these documents."""
        on = [m for m in self.switches if m.gradient_checkpointing is True]
        keeps = any(recompute.keeps_cores(m) for m in on)  # the compiled loop's checkpoints keep the cores
        f = step_flops(self.config, list(doc_lens), gradient_checkpointing=bool(on), keep_mixer_cores=keeps, **self.kw)
        return f.model, f.hardware


class StepLog:
    """Every step's record in (`add`), the logged step's record and line out (`log`): tokens/s and MFU over the
    steps since the last log (a `Throughput`), `loss` = the mean of those steps' losses (`loss_steps` of them;
    `step_loss` = the logged step's own), the run's length and the time left (`eta_s`: the steps to go at the
    wall-clock pace since this process's first step, evals and saves included; the first step, which compiles,
    only while it is the one step there is)."""

    def __init__(self, total_steps: int, done: int, logging_steps: int, peak_flops: float | None = None) -> None:
        self.tput = Throughput(peak_flops)
        self.total, self.every = total_steps, logging_steps
        self.losses: list[float] = []
        self.own: dict[
            str, list[float]
        ] = {}  # the objective's metrics (a record's `objective`), averaged like the loss
        self.t0 = time.perf_counter()
        self.first: tuple[int, float] | None = None  # (step, wall time) at the end of this process's first step

    def skip(self, seconds: float) -> None:
        """Leave `seconds` out of tokens/s and MFU (`Throughput.skip`); the time left still counts them."""
        self.tput.skip(seconds)

    def add(self, rec: dict) -> None:
        """A completed step's record (its `model_flops` and `hardware_flops` are taken out of it)."""
        self.tput.add(rec["tokens"], rec.pop("model_flops"), rec.pop("hardware_flops", None))
        self.losses.append(rec["loss"])
        for k, v in rec.pop(OBJECTIVE, {}).items():
            self.own.setdefault(k, []).append(v)
        if self.first is None:
            self.first = (rec["step"], time.perf_counter())

    def due(self, step: int, stop: bool) -> bool:
        """Whether this step is logged: every `logging_steps`, the first, the last, and a stopping one."""
        return step % self.every == 0 or step == self.total or step == 1 or stop

    def eta(self, step: int) -> float:
        first_step, t_first = self.first or (step, self.t0)
        now = time.perf_counter()
        per_step = (now - t_first) / (step - first_step) if step > first_step else now - self.t0
        return per_step * max(self.total - step, 0)

    def log(self, rec: dict, mem_gib: float, metrics: MetricsLog | None) -> dict:
        """Complete the logged step's record (the window's loss mean, throughput, memory, time left), write it to
        metrics.jsonl (and the trackers) and log its line."""
        window, self.losses = self.losses or [rec["loss"]], []
        rec.update(loss=sum(window) / len(window), step_loss=rec["loss"], loss_steps=len(window), **self.tput.take())
        own, self.own = {k: sum(v) / len(v) for k, v in self.own.items()}, {}
        rec.update(own)
        rec.update(mem_gib=mem_gib, total_steps=self.total, eta_s=self.eta(rec["step"]), type="train")
        if self.first is not None and rec["step"] == self.first[0]:  # compiling and autotuning included
            rec["first_step_s"] = round(self.first[1] - self.t0, 2)
        if metrics is not None:
            metrics.write(rec)
        logger.info("%s", format_step(rec, list(own)))
        return rec


class MetricsLog:
    """Appends one JSON object per line; each record is flushed so a crash loses nothing logged. A `tracker`
    (trackers.py) gets every record too, and is closed with the log."""

    def __init__(self, path: Path, truncate: bool, after_step: int | None = None, tracker=None) -> None:
        """`truncate`: start an empty file. `after_step`: a resumed run's step; rows an earlier process logged past
        it (and a line a kill left torn) are dropped, since the resumed run logs those steps again."""
        self.tracker = tracker
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_symlink() and truncate:
            self.path.unlink()  # a planted link is never written through; a fresh log replaces it
        elif self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
            raise OutputDirError(f"'{self.path}' is not a plain file (a link?); move it away and run again")
        if not truncate and after_step is not None and self.path.is_file():
            kept = []
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    continue  # torn by a kill mid-write, or nested past the recursion limit (never a record of ours)
                if isinstance(row, dict) and row.get("step", 0) <= after_step:
                    kept.append(line + "\n")
            atomic_write_text(self.path, "".join(kept))
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_APPEND) | getattr(os, "O_NOFOLLOW", 0)
        self.f = os.fdopen(os.open(self.path, flags, 0o666), "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.f is not None:
            try:
                self.f.write(json.dumps(record) + "\n")
                self.f.flush()
            except OSError as e:  # a full disk, a file-size limit, a failed disk: the run goes on, said once
                self._refused(e)
        if self.tracker is not None:
            self.tracker.log(record)

    def _refused(self, e: OSError) -> None:
        why = os.strerror(e.errno) + f" ({errno.errorcode.get(e.errno, e.errno)})" if e.errno else str(e)
        logger.warning(
            "%s: could not write a step's metrics (%s); training goes on, the step lines stay in the log and "
            "nothing more is written to this file: free the disk or raise the limit for the next run",
            self.path,
            why,
        )
        f, self.f = self.f, None
        try:
            f.close()
        except OSError:
            pass  # (the same refusal, flushing what was buffered)

    def close(self) -> None:
        if self.f is not None:
            try:
                self.f.close()
            except OSError as e:
                self._refused(e)
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.close()


def format_duration(seconds: float) -> str:
    """`H:MM:SS`.

    >>> format_duration(3725.4), format_duration(59.6)
    ('1:02:05', '0:01:00')
    """
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_step(rec: dict, own: list[str] | tuple = ()) -> str:
    """The one log line per logged step, on a terminal or not: `step N/TOTAL loss grad_norm lr tok/s [tflops mfu]
    mem eta` (`loss`: the mean over the steps since the last logged one; `mem`: the peak over ranks under torchrun;
    `mfu`: model FLOPs, without recompute, over the measured peak of the run's devices; `hfu`: the same with
    gradient checkpointing's recompute, shown where it differs; `eta`: the time left;
    `first step`: the wall time of this process's first step, compiling included), then the objective's own metrics
    named in `own` (means over the same steps as the loss).

    >>> format_step({"step": 7, "total_steps": 100, "loss": 1.5, "grad_norm": 0.25, "lr": 1e-4,
    ...              "tokens_per_s": 31000.4, "tflops": 250.0, "mfu": 0.41, "mem_gib": 5.5, "eta_s": 83.0})
    'step     7/100  loss 1.5000  grad_norm 0.250  lr 1.00e-04  tok/s 31,000  tflops 250  mfu 41.0%  mem 5.50 GiB  eta 0:01:23'
    """
    flops = f"tflops {rec['tflops']:.3g}  " if "tflops" in rec else ""
    if "mfu" in rec:
        flops += f"mfu {100 * rec['mfu']:.1f}%  "
        if rec.get("hfu", rec["mfu"]) > rec["mfu"]:
            flops += f"hfu {100 * rec['hfu']:.1f}%  "
    total = f"/{rec['total_steps']}" if "total_steps" in rec else ""
    eta = f"  eta {format_duration(rec['eta_s'])}" if "eta_s" in rec else ""
    if "first_step_s" in rec:
        eta += f"  first step {rec['first_step_s']:.1f} s"
    eta += "".join(f"  {k} {rec[k]:.4g}" for k in own)
    return (
        f"step {rec['step']:>5}{total}  loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  "
        f"lr {rec['lr']:.2e}  tok/s {rec['tokens_per_s']:,.0f}  {flops}mem {rec['mem_gib']:.2f} GiB{eta}"
    )
