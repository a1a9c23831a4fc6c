"""Data: formats -> (ids, loss mask) -> packing -> collator."""

from hybridtune.data.chat import with_chat_template
from hybridtune.data.collator import IGNORE_INDEX, PackedCollator, varlen_metadata
from hybridtune.data.packing import Example, pack

__all__ = ["IGNORE_INDEX", "Example", "PackedCollator", "pack", "varlen_metadata", "with_chat_template"]
