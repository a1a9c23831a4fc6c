"""Command-line entry point: `hybridtune {train,data,bench,doctor,compile,merge,generate,chat,eval,export}`.

Each command lives in the layer it drives and exposes `main(argv) -> int | None`; this module only
dispatches, sets up logging, and turns `UserError` into one line on stderr with exit code 2.
Subcommand modules are imported lazily so `hybridtune doctor` does not pay for the training stack.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from hybridtune import __version__
from hybridtune.errors import UserError, did_you_mean, printable

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("hybridtune.train.command", "fine-tune a model on packed data (full fine-tune by default, or LoRA)"),
    "bench": ("hybridtune.bench.command", "training modes side by side: tokens/s, memory, FLOP utilisation, loss"),
    "doctor": ("hybridtune.kernels.doctor", "versions, GPU, kernel paths and fixes; the presets and example configs"),
    "compile": ("hybridtune.compiler.modules.command", "generate standalone per-class forwards (--family, --sweep)"),
    "merge": ("hybridtune.infer.merge_command", "merge a LoRA adapter into its base model and save safetensors"),
    "data": ("hybridtune.infer.data_preview", "the data as training sees it: rows rendered, trained tokens marked"),
    "generate": ("hybridtune.infer.generate", "completions of prompts from a trained model, checkpoint or adapter"),
    "chat": ("hybridtune.infer.chat", "talk to a model interactively (streams on a terminal; /reset, /exit)"),
    "eval": ("hybridtune.infer.evaluate", "loss, perplexity and exact match of a model on a dataset (the trainer's)"),
    "export": ("hybridtune.infer.export_command", "a checkpoint-N as a model transformers and peft load"),
}

USAGE = (
    "usage: hybridtune {"
    + ",".join(COMMANDS)
    + "} [options]\n\ncommands:\n"
    + "\n".join(f"  {name:<9}{desc}" for name, (_, desc) in COMMANDS.items())
)


def _setup_logging() -> None:
    """Rich output on a terminal; plain one-line records elsewhere (logs, CI, pipes)."""
    level = os.environ.get("HYBRIDTUNE_LOG_LEVEL", "INFO").upper()
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, show_time=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("hybridtune")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


# transformers' notice that a kernel-hub function runs its reference PyTorch code (integrations/hub_kernels.py), said
# only while that reference runs. Under hybridtune the mixers run its own ops or that same reference, and the kernel
# report (train) and `hybridtune doctor` say which path each takes; four such notices would land in the middle of the
# output (a chat's first reply). Where a faster path exists (a GPU), one line of ours says so instead.
FALLBACK_NOTICE = "is falling back to its reference PyTorch implementation"
FALLBACK_LOGGER = "transformers.integrations.hub_kernels"
_said: list[bool] = []


def drop_fallback_notice(record: logging.LogRecord) -> bool:
    if FALLBACK_NOTICE not in record.getMessage():
        return True
    torch = sys.modules.get("torch")  # (loaded: a model is running)
    if not _said and torch is not None and torch.cuda.is_available():
        _said.append(True)
        logging.getLogger(__name__).warning(
            "slow path: the linear-attention mixers run transformers' reference PyTorch ops on this GPU (fast "
            "kernels not installed); run `hybridtune doctor` for the fix"
        )
    return False


def _quiet_transformers() -> None:
    """Drop transformers' reference-fallback notice (see FALLBACK_NOTICE); its other messages pass."""
    log = logging.getLogger(FALLBACK_LOGGER)
    if drop_fallback_notice not in log.filters:
        log.addFilter(drop_fallback_notice)


def _stack_dumps_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr (a stalled run says where it is)."""
    import faulthandler
    import signal

    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except (OSError, ValueError, AttributeError):  # stderr without a file descriptor (captured, embedded)
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"hybridtune {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        hint = did_you_mean(name, COMMANDS)
        print(f"error: unknown command '{name}'.{hint} Commands: {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    _setup_logging()
    _quiet_transformers()
    _stack_dumps_on_sigusr1()
    try:
        module = importlib.import_module(COMMANDS[name][0])
        rc = module.main(rest)
    except UserError as e:
        print(f"error: {printable(str(e))}", file=sys.stderr)  # (a row's or a path's ESC reaches no terminal)
        return e.exit_code
    except BrokenPipeError:
        # The reader of stdout went away (`hybridtune train --help | head`): nothing more to say to it. Python's
        # own flush at exit would fail again on the same pipe, so stdout points at devnull from here.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":  # (torchrun's other ranks: rank 0 speaks for the run)
            print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
