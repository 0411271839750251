"""What a model can be split into (services/supervisor/topology.py), how `lockstep up`
settles tp/pp from what the user named (services/up/model.py), and the sampling defaults'
order (common/sampling_defaults.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.sampling_defaults import Origin, SamplingOverrides, check_overrides, resolve
from services.supervisor import topology as topo
from services.supervisor.topology import TopologyError, check, read_shape
from services.up.model import PRESETS, Preset, sampling, topology

SMOLLM2 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
           "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
           "num_hidden_layers": 30, "hidden_size": 576}


def model(tmp_path, config, index=True, name="smollm2"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if index:
        (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    return d


def test_smollm2_shape_names_its_numbers_and_the_valid_choices(tmp_path):
    d = model(tmp_path, {**SMOLLM2, "model_type": "qwen2"})
    with pytest.raises(TopologyError) as ei:
        check(d, 2, 1)
    assert str(ei.value) == (
        "smollm2: 9 heads, 3 KV heads, MLP size 1536, 30 layers: tp=2 does not divide its "
        "9 heads and 3 KV heads; valid: --tp 1 or 3, or --pp 2..30")
    for tp, pp in ((1, 1), (3, 1), (1, 2), (1, 30)):
        check(d, tp, pp)
    with pytest.raises(TopologyError, match="pp=31 is more than its 30 layers"):
        check(d, 1, 31)
    with pytest.raises(TopologyError, match="tp > 1 together with pp > 1"):
        check(d, 3, 2)


def test_an_architecture_mlx_lm_cannot_pipeline_is_refused_by_name(tmp_path):
    d = model(tmp_path, SMOLLM2)  # mlx-lm's llama has a shard but no pipeline
    shape = read_shape(d)
    assert shape.can_tp and not shape.can_pp
    with pytest.raises(TopologyError, match=r"\(llama\) cannot be pipelined.*valid: --tp 1 or 3$"):
        check(d, 1, 2)


def test_pipeline_needs_the_weight_index_and_unknown_models_are_refused(tmp_path):
    d = model(tmp_path, {**SMOLLM2, "model_type": "qwen2"}, index=False)
    with pytest.raises(TopologyError, match="model.safetensors.index.json"):
        check(d, 1, 2)
    odd = model(tmp_path, {**SMOLLM2, "model_type": "no_such_arch"}, name="odd")
    with pytest.raises(TopologyError, match=r"\(no_such_arch\) has no tensor-parallel shard"):
        check(odd, 3, 1)
    with pytest.raises(TopologyError, match="cannot read config.json"):
        check(tmp_path / "missing", 1, 1)


def test_the_source_reading_agrees_with_mlx_lms_import_wherever_it_answers():
    """`_arch_in_source` answers (True, True) only where importing the module, as mlx-lm's
    `_get_classes` does, says the same; every other answer is left to the import."""
    root = topo._mlx_lm_dir()
    names = sorted(p.stem for p in (root / "models").glob("*.py") if not p.stem.startswith("_"))
    answered = [n for n in names if topo._arch_in_source({"model_type": n}) is not None]
    assert {"qwen2", "deepseek_v3"} <= set(answered)  # the tiny presets' architecture among them
    for n in answered:
        assert topo._arch_imported({"model_type": n}) == (True, True), n
    by_type, _ = topo._remappings(root / "utils.py")
    assert by_type["mistral"] == "llama"  # mlx-lm's remapping, read as a literal
    assert topo._arch_in_source({"model_type": "../utils"}) is None


def test_checking_a_pipelined_qwen2_imports_no_mlx_lm(tmp_path):
    """`lockstep up` and the supervisor check the topology before anything starts; for the
    presets' architecture that check reads mlx-lm's source and imports none of it."""
    d = model(tmp_path, {**SMOLLM2, "model_type": "qwen2"})
    code = ("import sys; from services.supervisor.topology import check; "
            f"check({str(d)!r}, 1, 2); check({str(d)!r}, 3, 1); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx_lm', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2], check=True)
    assert out.stdout.strip() == "[]"


def test_what_the_user_names_wins_dimension_by_dimension():
    smol = PRESETS["smollm2"]
    assert topology({}, smol) == (1, 2)
    assert topology({"pp": 1}, smol) == (1, 1)  # not the generic default's tp=2
    assert topology({"tp": 3}, smol) == (3, 1)  # a named split above 1 leaves the other 1
    assert topology({"tp": 1}, smol) == (1, 2)
    assert topology({"pp": 3}, smol) == (1, 3)
    assert topology({}, None) == (2, 1)
    assert topology({"pp": 2}, None) == (1, 2)
    assert topology({"pp": 1}, Preset()) == (2, 1)
    assert topology({"tp": 2, "pp": 2}, smol) == (2, 2)  # named both: the check refuses


def test_sampling_order_operator_over_generation_config_over_server(tmp_path):
    d = model(tmp_path, SMOLLM2)
    assert resolve(d, None).temperature == 1.0  # nothing said anywhere: OpenAI's
    (d / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.2, "top_p": 0.9, "top_k": 50.0, "min_p": 5, "do_sample": False}))
    got = resolve(d, SamplingOverrides(top_p=0.5))
    assert (got.temperature, got.top_p, got.top_k, got.min_p) == (0.2, 0.5, 50, 0.0)
    assert got.origin == {"temperature": Origin.GENERATION_CONFIG, "top_p": Origin.OPERATOR,
                          "top_k": Origin.GENERATION_CONFIG, "min_p": Origin.SERVER,
                          "repetition_penalty": Origin.SERVER,  # min_p 5: out of range, unused
                          "xtc_probability": Origin.SERVER, "xtc_threshold": Origin.SERVER}
    assert got.describe().startswith("temperature 0.2 (generation_config), top_p 0.5 (operator)")
    (d / "generation_config.json").write_text("{not json")
    assert resolve(d, None).origin["temperature"] is Origin.SERVER


def test_the_default_presets_sampling_is_greedy_and_the_user_wins():
    smol = PRESETS["smollm2"]
    assert sampling(SamplingOverrides(), smol).temperature == 0.0
    assert sampling(SamplingOverrides(temperature=0.7), smol).temperature == 0.7
    assert sampling(SamplingOverrides(), None) == SamplingOverrides()
    assert check_overrides(SamplingOverrides(temperature=2.5, top_p=0.0, top_k=-2)) == [
        "temperature must be a finite number in [0, 2]",
        "top_p must be a finite number in (0, 1]", "top_k must be an integer in [-1, 2^24]"]


def test_a_preset_name_is_not_a_same_named_folder_without_a_model(tmp_path, monkeypatch):
    from services.up.model import model_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # e.g. the repo's bench/ sources for `--model bench`
    path, preset = model_dir(tmp_path / "models", "tiny", lambda msg: None)
    assert path == str(tmp_path / "models" / "tiny") and preset == Preset()
    (tmp_path / "tiny" / "config.json").write_text("{}")  # a real model folder wins
    assert model_dir(tmp_path / "models", "tiny", lambda msg: None)[0] == str(tmp_path / "tiny")
