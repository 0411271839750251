"""The embedded default model: a random-weight Qwen2 with a locally trained tokenizer."""

from .build import STAMP, ModelDirError, build_model, is_complete, main, read_stamp
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
