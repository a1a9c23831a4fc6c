"""`hybridtune merge ADAPTER_DIR OUT_DIR`: fold a LoRA adapter into its base and save safetensors.

The result loads with `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` and gives the
same logits as base + adapter. The output is written atomically; an existing OUT_DIR is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hybridtune.errors import ModelError, OutputDirError

logger = logging.getLogger(__name__)


def merge(adapter_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridtune.train.checkpoint import atomic_dir

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ModelError(
            f"'{adapter_dir}' has no adapter_config.json; give the adapter directory (e.g. OUTPUT_DIR/final)"
        )
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputDirError(
            f"'{out_dir}' already exists and is not empty; choose another directory or pass --overwrite"
        )
    pcfg = PeftConfig.from_pretrained(str(adapter_dir))
    base_path = Path(pcfg.base_model_name_or_path or "")
    if not base_path.is_dir():
        raise ModelError(
            f"the adapter's base model '{pcfg.base_model_name_or_path}' is not a local directory; "
            f"edit base_model_name_or_path in {adapter_dir / 'adapter_config.json'}"
        )
    base = AutoModelForCausalLM.from_pretrained(str(base_path))
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    merged = model.merge_and_unload()
    tok_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_path

    def write(tmp: Path) -> None:
        merged.save_pretrained(tmp, safe_serialization=True)
        if (tok_dir / "tokenizer_config.json").is_file():
            AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(tmp)
        (tmp / "hybridtune.json").write_text(
            json.dumps({"merged_from": str(adapter_dir), "base": str(base_path)}, indent=2)
        )

    atomic_dir(out_dir, write)
    logger.info("merged %s into %s -> %s", adapter_dir, base_path, out_dir)
    return out_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridtune merge", description=__doc__.splitlines()[0])
    parser.add_argument("adapter_dir", help="LoRA adapter directory (OUTPUT_DIR/final)")
    parser.add_argument("out_dir", help="where to write the merged model (must not exist)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    args = parser.parse_args(argv)
    merge(args.adapter_dir, args.out_dir, args.overwrite)
    return 0
