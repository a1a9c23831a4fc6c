"""`hybridtune train [CONFIG.yaml] [--key value ...] [--nproc N] [--nnodes N --node_rank R --master_addr A]`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hybridtune.config import config_help, load_config, parse_overrides
from hybridtune.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

# How long a rank other than 0 that met an input mistake waits for rank 0 to say it (see _after_rank0).
RANK0_GRACE_S = 30.0
# A rank stopped by torchrun after another failed: killed by SIGTERM, or its handler's exit (130 during setup, where
# SIGTERM interrupts; 143 once training, where it saves and stops).
STOPPED_CODES = frozenset({-signal.SIGTERM, 130, 128 + signal.SIGTERM})

USAGE = """usage: hybridtune train [CONFIG.yaml] [--key value ...] [--nproc N]
                       [--nnodes N --node_rank R --master_addr HOST [--master_port PORT]]

Fine-tune a model. The default is a full fine-tune (every weight trained); --adapter lora trains a
LoRA adapter instead. With no arguments: a full fine-tune of the tiny Qwen3.5 preset (random weights)
on the bundled arithmetic chats (a few minutes on a CPU). A YAML file sets keys; --key value (or
--key=value) overrides them. --dataset FILE is the shorthand for one data file (format detected, or
--dataset_type). --base_model takes a local checkpoint directory, a hub id (org/name, with
--revision) or a preset; `hybridtune doctor` lists the presets and the bundled example configs
(e.g. `hybridtune train hybridtune:configs/arithmetic-lora.yaml`).

--nproc N trains with N processes on this machine (one per GPU) through torchrun; the same as
`torchrun --nproc-per-node N -m hybridtune train ...`. The engine is the `distributed` key (DDP for
LoRA, FSDP2 for a full fine-tune); the global batch and the schedule do not depend on N.

--nnodes N trains over N machines, --nproc processes on each: run the same command on every machine
with its own --node_rank (0 .. N-1) and the address of node 0 as --master_addr (--master_port, default
29500, free there); the same as torchrun's flags of those names. output_dir must be one directory every
machine sees (a shared filesystem): checkpoints are written there by every rank.
"""

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Launch:
    """The launcher flags of `hybridtune train`: processes per machine, machines, this machine's rank, node 0."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    def torchrun_args(self) -> list[str]:
        """torchrun's flags for this launch: standalone (a local rendezvous) on one machine, node 0's address with
        the static rendezvous over several."""
        common = [f"--nproc-per-node={self.nproc}", "--max-restarts=0"]
        if self.nnodes == 1:
            return ["--standalone", *common]
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            *common,
        ]


class TrainingFailed(UserError):
    """A rank of a multi-process run failed; the message names it."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


_FLAGS = {
    "nproc": ("--nproc", "--nproc-per-node", "--nproc_per_node"),
    "nnodes": ("--nnodes",),
    "node_rank": ("--node_rank", "--node-rank"),
    "master_addr": ("--master_addr", "--master-addr"),
    "master_port": ("--master_port", "--master-port"),
}
_EXAMPLE = {"nproc": "2", "nnodes": "2", "node_rank": "0", "master_addr": "10.0.0.1", "master_port": "29500"}


def _take_launch(argv: list[str]) -> tuple[Launch, list[str]]:
    """Remove the launcher flags (`--nproc N`, `--nnodes N`, `--node_rank R`, `--master_addr A`, `--master_port P`,
    each also as `--flag=value` and in torchrun's dashed spelling) from argv: they are not config keys."""
    names = {flag: key for key, flags in _FLAGS.items() for flag in flags}
    rest, raw, i = [], {}, 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        key = names.get(flag)
        if key is None:
            rest.append(argv[i])
        else:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"command line: {flag} needs a value, e.g. {flag} {_EXAMPLE[key]}")
                value, i = argv[i + 1], i + 1
            raw[key] = (flag, value)
        i += 1
    values: dict = {}
    for key in ("nproc", "nnodes", "node_rank", "master_port"):
        if key in raw:
            flag, value = raw[key]
            low = 0 if key == "node_rank" else 1
            high = 65535 if key == "master_port" else None  # a TCP port
            if not value.isdigit() or int(value) < low or (high is not None and int(value) > high):
                what = "a number from 0" if low == 0 else "a positive number"
                what += f" up to {high}" if high is not None else ""
                raise ConfigError(f"command line: {flag} {value!r} must be {what}, e.g. {flag} {_EXAMPLE[key]}")
            values[key] = int(value)
    if "master_addr" in raw:
        values["master_addr"] = raw["master_addr"][1]
    launch_ = Launch(**values)
    _check_nodes(launch_, {k: flag for k, (flag, _) in raw.items()})
    return launch_, rest


def _check_nodes(launch_: Launch, given: dict[str, str]) -> None:
    if launch_.nnodes == 1:
        extra = [given[k] for k in ("node_rank", "master_addr", "master_port") if k in given]
        if extra:
            raise ConfigError(
                f"command line: {', '.join(extra)} without --nnodes: they place this machine among several; add "
                "--nnodes N (the number of machines), or leave them out on one machine"
            )
        return
    missing = [
        flag for key, flag in (("node_rank", "--node_rank"), ("master_addr", "--master_addr")) if key not in given
    ]
    if missing:
        raise ConfigError(
            f"command line: --nnodes {launch_.nnodes} needs {' and '.join(missing)}: this machine's rank (0 .. "
            f"{launch_.nnodes - 1}) and the address of node 0, which every machine reaches"
        )
    if launch_.node_rank >= launch_.nnodes:
        raise ConfigError(
            f"command line: --node_rank {launch_.node_rank} is not below --nnodes {launch_.nnodes}; the machines are "
            f"ranked 0 .. {launch_.nnodes - 1}"
        )


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        print(config_help())
        return 0
    how, argv = _take_launch(argv)
    config_args = argv
    path = None
    if argv and not argv[0].startswith("--"):
        path, argv = argv[0], argv[1:]
    launching = how.world > 1 and "WORLD_SIZE" not in os.environ
    # (launching: rank 0 says the warnings; on several machines, node 0's)
    cfg = load_config(path, parse_overrides(argv), warn=not launching)
    if launching:
        return launch(how, config_args, cfg)
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import record

        # A rank's unexpected exception goes to the file torchrun reads; the launcher's one line quotes it. A
        # UserError is not unexpected: rank 0 says it in one line here, and no traceback reaches torchrun's report.
        return _leave(record(_train_or_say)(cfg))
    return _train(cfg)


def _after_rank0(e: UserError) -> None:
    """A rank other than 0 met an input mistake. Rank 0 reads the same input and meets the same one, says it in one
    line and exits, and torchrun then stops this rank: wait for that rather than exit first (torchrun would stop
    rank 0 before it said anything). A mistake rank 0 does not meet within RANK0_GRACE_S is this rank's own: say it."""
    deadline = time.monotonic() + RANK0_GRACE_S
    while time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"error: {e}", file=sys.stderr)


def _leave(code: int) -> int:
    """End a torchrun rank at once with `code`, its output flushed, past the interpreter's teardown: there, threads
    that torch's C++ side leaves running (the profiler's, the process group's) have aborted a finished rank
    ("terminate called without an active exception", SIGSEGV) after its last line, failing a run that had saved
    everything. Everything of the run is closed by now (files, lock, process group)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it anyway
            pass
    os._exit(code)


def _train_or_say(cfg) -> int:
    try:
        return _train(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


_KEPT: list = []  # the finished trainer of a torchrun rank, freed by the process's end only (see _train)


def _train(cfg) -> int:
    # Imported here, past argument parsing: `hybridtune train --help` and a config error answer without loading
    # torch and transformers.
    from hybridtune.run.outdir import RUN_FILE
    from hybridtune.runtime import distributed
    from hybridtune.runtime.nodes import check_shared_output_dir
    from hybridtune.train.trainer import Trainer

    is_main = int(os.environ.get("RANK", "0")) == 0
    trainer = None
    try:
        try:
            trainer = Trainer(cfg)  # joins the process group under torchrun: errors here are per rank too
            trainer.setup()
            check_shared_output_dir(trainer.dist, trainer.out / RUN_FILE)
            progress = _progress(trainer.total_steps, trainer.step) if trainer.dist.is_main else None
            if progress is not None:
                trainer.on_log = lambda rec: progress.update(rec)
            try:
                result = trainer.train()
            finally:
                if progress is not None:
                    progress.stop()
        except UserError as e:
            if is_main:
                raise
            _after_rank0(e)
            return e.exit_code
    finally:
        if trainer is not None:
            trainer.close()
            distributed.shutdown(trainer.dist)
            if trainer.dist.enabled:
                # Kept alive to the rank's os._exit (_leave): freeing it here ran DDP's Reducer destructor after
                # the process group was destroyed, whose gloo group then waited on a lock for ever (a rank that
                # never exited after 'done'; seen with py-spy --native).
                _KEPT.append(trainer)
    if result.interrupted:
        return 128 + signal.SIGTERM if result.signal == "SIGTERM" else 130  # the shell's convention
    if not trainer.dist.is_main:
        return 0
    if result.losses:
        summary = f"done: {result.steps} steps, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"
    elif result.steps == 0:
        summary = "done: max_steps 0, nothing trained: the starting model evaluated and exported"
    else:
        summary = f"done: nothing left to train (the run was at step {result.steps} of {result.steps})"
    if rewards := getattr(trainer.rollouts, "rewards", None):  # (grpo: the mean reward of the first and last rollout)
        summary += f", reward {rewards[0]:.4f} -> {rewards[-1]:.4f}"
    if len(result.evals) >= 2:
        summary += f", exact_match {result.evals[0]['exact_match']:.3f} -> {result.evals[-1]['exact_match']:.3f}"
    summary += f"; final model in {result.final_dir}"
    logger.info("%s", summary)
    return 0


class _Bar:
    def __init__(self, total: int, done: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeRemainingColumn(),
            transient=True,
        )
        self.task = self.p.add_task("train", total=total, completed=done, loss="-")
        self.p.start()

    def update(self, rec: dict) -> None:
        self.p.update(self.task, completed=rec["step"], loss=f"{rec['loss']:.3f}")

    def stop(self) -> None:
        self.p.stop()


def _progress(total: int, done: int):
    """A progress bar on an interactive terminal only (logs and CI get the step lines alone)."""
    if not sys.stderr.isatty():
        return None
    return _Bar(total, done)


def launch(how: Launch, argv: list[str], cfg) -> int:
    """Run `hybridtune train ARGV` in `how.nproc` processes on this machine (one of `how.nnodes`) through torchrun's
    own launcher.

    A failed rank ends the whole run (torchrun stops the others); this turns its report into one line
    naming each failed rank and its exit code or signal, and the first line of its error when it left one.
    """
    # Here, not at the top: the launcher alone needs torch and torchrun (see _train for the same reason).
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from hybridtune.run.checkpoint import list_checkpoints
    from hybridtune.runtime.distributed import GPU_ENV_DEFAULTS, Dist, check_window

    nproc = how.nproc
    # Input mistakes are found here, once, before N processes each load a model and say it N times.
    check_window(Dist(world=how.world), cfg.gradient_accumulation_steps)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.device == "cuda" and gpus == 0:
        raise ConfigError(
            "device 'cuda' asked for but no CUDA GPU is visible; use --device cpu (gloo) or a GPU machine"
        )
    if cfg.device != "cpu" and gpus and nproc > gpus:
        raise ConfigError(
            f"--nproc {nproc} needs {nproc} GPUs but {gpus} are visible (CUDA_VISIBLE_DEVICES); "
            f"use --nproc {gpus} or fewer, or --device cpu"
        )
    for k, v in GPU_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    args = get_args_parser().parse_args([*how.torchrun_args(), "-m", "hybridtune", "train", *argv])
    if how.nnodes == 1:
        logger.info("launching %d processes through torchrun", nproc)
    else:
        logger.info(
            "launching %d processes through torchrun: node %d of %d (%d processes in all), node 0 at %s:%d",
            nproc,
            how.node_rank,
            how.nnodes,
            how.world,
            how.master_addr,
            how.master_port,
        )
    # torchrun's own log lines (its OMP_NUM_THREADS banner, "closing signal", "failed (exitcode ...)") would surround
    # the ranks' one line; what they say is in that line or in the one below. Its default of 1 thread is kept.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)
    try:
        run(args)
    except SignalException as e:
        # Ctrl-C (or a SIGTERM to the launcher): the ranks finish their step and save together within torchrun's
        # grace period, else it stops them; the newest complete checkpoint, if any, is where to continue.
        found = list_checkpoints(Path(cfg.output_dir))
        if found:
            logger.warning(
                "interrupted (%s): every rank stopped; continue from %s with --resume_from_checkpoint latest",
                e.sigval.name,
                found[-1].name,
            )
        else:
            logger.warning("interrupted (%s): every rank stopped before any checkpoint; run again", e.sigval.name)
        raise KeyboardInterrupt from None
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        if input_mistake({f.exitcode for _, f in failures}):
            raise SystemExit(UserError.exit_code) from None
        raise TrainingFailed(blame(failures)) from None
    return 0


def input_mistake(codes: set[int]) -> bool:
    """Whether the ranks' exit codes say a mistake in the input: a rank (rank 0, see _after_rank0) said which in one
    line and exited with UserError's code; the others were stopped by torchrun, by the signal or its handler (130
    during setup, 143 in training).

    >>> input_mistake({2, -15}), input_mistake({2, 130}), input_mistake({2, 1}), input_mistake({130})
    (True, True, False, False)
    """
    return UserError.exit_code in codes and codes <= {UserError.exit_code, *STOPPED_CODES}


def _message(failure) -> str:
    message = failure.message or ""
    if isinstance(message, dict):  # the JSON error file `record` wrote: {"message": ..., "extraInfo": ...}
        message = str(message.get("message", ""))
    return message.strip()


def _waited(failure) -> bool:
    """The rank failed waiting for the others in a collective (a timeout), not by itself."""
    low = _message(failure).lower()
    return failure.exitcode > 0 and ("timed out" in low or "timeout" in low)


def blame(failures: list[tuple[int, object]]) -> str:
    """One line naming the ranks that caused a failed run first, then the ones that only followed it: torchrun ends
    the surviving ranks with SIGTERM once one fails, and a rank that stalls (stopped, hung) makes the others time out
    in a collective before torchrun kills it.

    >>> from types import SimpleNamespace as F
    >>> blame([(0, F(exitcode=1, pid=10, message="collective timed out after 600 s")), (1, F(exitcode=-9, pid=11,
    ...        message=""))])
    'rank 1 (pid 11) was killed by SIGKILL; rank 0 then timed out waiting for it'
    """
    failures = sorted(failures, key=lambda rf: rf[0])
    stopped = [r for r, f in failures if f.exitcode == -signal.SIGTERM]
    waited = [r for r, f in failures if _waited(f)]
    cause = [(r, f) for r, f in failures if r not in stopped and r not in waited]
    if not cause:  # nothing else to blame: say what there is
        cause, waited, stopped = [(r, f) for r, f in failures if r not in stopped] or failures, [], []
    line = "; ".join(_describe(rank, f) for rank, f in cause)
    if waited:
        who = "it" if len(cause) == 1 else "them"
        line += f"; rank{'s' if len(waited) > 1 else ''} {', '.join(map(str, waited))} then timed out waiting for {who}"
    if stopped:
        line += f"; torchrun then stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))}"
    return line


def _describe(rank: int, failure) -> str:
    code = failure.exitcode
    if code < 0:
        try:
            what = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            what = f"was killed by signal {-code}"
    else:
        what = f"exited with code {code}"
    text = f"rank {rank} (pid {failure.pid}) {what}"
    message = _message(failure)
    # torchrun's placeholders ("To enable traceback...", "Signal 9 (SIGKILL) received by PID ...") add nothing.
    if message and not message.startswith(("To enable traceback", "Signal ")):
        text += f": {message.splitlines()[0][:300]}"
    return text
