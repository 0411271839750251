"""The embedded default model: a random-weight Qwen2 with a locally trained tokenizer."""

from models.atomic_build import STAMP, ModelDirError, read_stamp

from .build import build_model, is_complete, main
from .weights import PRESETS, Preset

__all__ = [
    "PRESETS",
    "STAMP",
    "ModelDirError",
    "Preset",
    "build_model",
    "is_complete",
    "main",
    "read_stamp",
]
