"""Which tp and pp a model can be served with, read from its config.json before any
process starts: a refusal that names the model's numbers and the valid choices beats a
canary that fails in MLX's attention after every rank has loaded.

What mlx-lm's `sharded_load` needs (mlx_lm/utils.py, models/*.py):
- tensor parallel: the architecture has `Model.shard`, and the shard splits the attention
  heads, the KV heads and the MLP's hidden size evenly (`n_heads //= N` silently floors,
  so 9 heads on 2 ranks would load and then fail every attention call);
- pipeline parallel: the architecture's inner model is a `PipelineMixin` (it has
  `pipeline`), every rank gets at least one layer, and the directory has
  `model.safetensors.index.json` (each rank loads only its layers' files);
- not both at once: `sharded_load` takes one group.
Lockstep's `lockstep up` (before it starts its services), `admin deploy` and
`POST /deployments` (in the supervisor's plan, before any rank) all ask `check`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
from dataclasses import dataclass
from functools import cache, reduce
from math import gcd
from pathlib import Path

MAX_LISTED_TP = 64  # the choices named in a refusal stop here


class TopologyError(ValueError):
    """tp/pp that this model cannot be served with; the text names the valid choices."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    heads: int
    kv_heads: int
    hidden: int | None  # the MLP's intermediate size, None when the config names none
    layers: int
    can_tp: bool  # the architecture has Model.shard
    can_pp: bool  # its inner model has pipeline()
    has_index: bool  # model.safetensors.index.json

    def tp_choices(self) -> list[int]:
        """Every tp > 1 that splits heads, KV heads and the MLP evenly."""
        if not self.can_tp:
            return []
        nums = [n for n in (self.heads, self.kv_heads, self.hidden) if n]
        if not nums:
            return []
        g = reduce(gcd, nums)
        return [n for n in range(2, min(g, MAX_LISTED_TP) + 1) if g % n == 0]

    def pp_max(self) -> int:
        """The largest pp (one layer a rank); 0 when pipelining is impossible."""
        return self.layers if self.can_pp and self.has_index and self.layers >= 2 else 0

    def choices(self) -> str:
        """'--tp 1 or 3, or --pp 2..30' — what a refusal offers."""
        tps = ["1", *map(str, self.tp_choices())]
        text = "--tp " + (" or ".join(tps) if len(tps) <= 2
                          else ", ".join(tps[:-1]) + " or " + tps[-1])
        pp = self.pp_max()
        if pp >= 2:
            text += f", or --pp {'2' if pp == 2 else f'2..{pp}'}"
        return text

    def numbers(self) -> str:
        parts = [f"{self.heads} heads", f"{self.kv_heads} KV heads"]
        if self.hidden:
            parts.append(f"MLP size {self.hidden}")
        return f"{self.name}: " + ", ".join(parts) + f", {self.layers} layers"

    def problems(self, tp: int, pp: int) -> list[str]:
        out = []
        if tp < 1 or pp < 1:
            out.append("tp and pp must be >= 1")
        if tp > 1 and pp > 1:
            out.append("tp > 1 together with pp > 1 is not supported (mlx-lm's sharded_load "
                       "takes one group)")
        if tp > 1 and not self.can_tp:
            out.append(f"its architecture ({self.model_type}) has no tensor-parallel shard in mlx-lm")
        elif tp > 1 and tp not in self.tp_choices():
            split = [what for n, what in ((self.heads, f"{self.heads} heads"),
                     (self.kv_heads, f"{self.kv_heads} KV heads"),
                     (self.hidden, f"MLP size {self.hidden}")) if n and n % tp]
            out.append(f"tp={tp} does not divide its {' and '.join(split)}")
        if pp > 1:
            if not self.can_pp:
                out.append(f"its architecture ({self.model_type}) cannot be pipelined by mlx-lm")
            elif not self.has_index:
                out.append("pipeline parallel needs model.safetensors.index.json in the model "
                           "directory")
            elif pp > self.layers:
                out.append(f"pp={pp} is more than its {self.layers} layers")
        return out


def _arch(config: dict) -> tuple[bool, bool]:
    """(has Model.shard, inner model pipelines) for the config's architecture, as mlx-lm
    picks it; (False, False) for one mlx-lm does not know. Read from mlx-lm's source when
    it says both plainly: importing any mlx_lm module runs its package __init__, which
    imports transformers (~1 s of CPU in `lockstep up` and again in the supervisor, before
    anything starts)."""
    if _arch_in_source(config) == (True, True):
        return True, True
    return _arch_imported(config)


def _arch_imported(config: dict) -> tuple[bool, bool]:
    try:
        from mlx_lm.models.pipeline import PipelineMixin
        from mlx_lm.utils import _get_classes  # mlx-lm's own model-type remapping
    except ImportError:
        return False, False
    try:
        model_cls, _ = _get_classes(config)
    except (ValueError, KeyError):
        return False, False
    module = importlib.import_module(model_cls.__module__)
    pipelines = any(isinstance(c, type) and issubclass(c, PipelineMixin)
                    and c is not PipelineMixin for c in vars(module).values())
    return hasattr(model_cls, "shard"), pipelines


def _arch_in_source(config: dict) -> tuple[bool, bool] | None:
    """(True, True) when the architecture's module, found as mlx-lm's `_get_classes` finds
    it, defines `Model.shard` and a class on `PipelineMixin` in plain sight; None when it
    does not say so (then the import decides: inherited methods, re-exported classes)."""
    root = _mlx_lm_dir()
    if root is None:
        return None
    try:
        by_type, by_arch = _remappings(root / "utils.py")
        model_type = _remapped_type(config, by_type, by_arch)
        if not model_type.isidentifier():
            return None
        tree = ast.parse((root / "models" / f"{model_type}.py").read_text())
    except (OSError, SyntaxError, ValueError, TypeError):
        return None
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    shard = any(c.name == "Model" and any(isinstance(f, ast.FunctionDef) and f.name == "shard"
                                          for f in c.body) for c in classes)
    pipelines = any((b.id if isinstance(b, ast.Name) else getattr(b, "attr", None))
                    == "PipelineMixin" for c in classes for b in c.bases)
    return (True, True) if shard and pipelines else None


def _mlx_lm_dir() -> Path | None:
    spec = importlib.util.find_spec("mlx_lm")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@cache
def _remappings(utils_py: Path) -> tuple[dict, dict]:
    """mlx-lm's MODEL_REMAPPING and MODEL_ARCHITECTURE_REMAPPING, as literals."""
    found: dict[str, dict] = {}
    for node in ast.parse(utils_py.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            name = node.targets[0].id
            if name in ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING"):
                found[name] = ast.literal_eval(node.value)
    if "MODEL_REMAPPING" not in found:
        raise ValueError("mlx_lm/utils.py: no MODEL_REMAPPING literal")
    return found["MODEL_REMAPPING"], found.get("MODEL_ARCHITECTURE_REMAPPING", {})


def _remapped_type(config: dict, by_type: dict, by_arch: dict) -> str:
    """The module name mlx-lm's `_get_classes` imports for this config."""
    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    for architecture in architectures:
        remapped = by_arch.get((model_type, architecture))
        if remapped is not None:
            return remapped
    return by_type.get(model_type, model_type)


def _int(cfg: dict, *names: str) -> int | None:
    for n in names:
        v = cfg.get(n)
        if type(v) is int and v > 0:
            return v
    return None


def read_shape(model_dir: str | Path, name: str | None = None) -> ModelShape:
    """The model's shape from its config.json; TopologyError when it cannot be read."""
    d = Path(model_dir)
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise TopologyError(f"{d}: cannot read config.json: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise TopologyError(f"{d}: config.json names no model_type")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    cfg = {**config, **text}  # a multimodal config keeps the language model's numbers inside
    heads = _int(cfg, "num_attention_heads", "n_heads") or 0
    can_tp, can_pp = _arch(config)
    return ModelShape(
        name=name or d.name, model_type=config["model_type"], heads=heads,
        kv_heads=_int(cfg, "num_key_value_heads", "n_kv_heads") or heads,
        hidden=_int(cfg, "intermediate_size", "moe_intermediate_size"),
        layers=_int(cfg, "num_hidden_layers", "n_layers") or 0,
        can_tp=can_tp, can_pp=can_pp,
        has_index=(d / "model.safetensors.index.json").is_file())


def check(model_dir: str | Path, tp: int, pp: int, name: str | None = None) -> ModelShape:
    """The shape, or TopologyError: 'smollm2: 9 heads, 3 KV heads, ...: tp=2 does not
    divide its 9 heads; valid: --tp 1 or 3, or --pp 2..30'."""
    shape = read_shape(model_dir, name)
    problems = shape.problems(tp, pp)
    if problems:
        raise TopologyError(f"{shape.numbers()}: {'; '.join(problems)}; valid: {shape.choices()}")
    return shape
