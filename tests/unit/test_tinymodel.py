"""The embedded default model: loads through the real mlx-lm loader, decodes varied greedy
text, builds deterministically and idempotently, and has a working ChatML tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.tinymodel import PRESETS, STAMP, ModelDirError, build_model, is_complete, main

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tinymodel") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def loaded(model_dir):
    from mlx_lm import load

    return load(str(model_dir))


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    from mlx_lm import stream_generate

    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # The default sampler is argmax.
    return [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=n)]


def _weight_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))}


@pytest.mark.timeout(60)
def test_greedy_output_varies_and_runs_to_max_tokens(loaded):
    model, tokenizer = loaded
    tokens = _greedy(model, tokenizer, "Hello, who are you?", 32)
    # Special and tool-call tokens are never produced, so there is no early stop.
    assert len(tokens) == 32
    assert len(set(tokens)) >= 8, tokens


@pytest.mark.timeout(60)
def test_same_seed_same_bytes_other_seed_differs(model_dir, tmp_path):
    again = build_model(tmp_path / "again", preset="tiny", seed=0)
    assert _weight_bytes(again) == _weight_bytes(model_dir)
    for name in ("tokenizer.json", "config.json", "model.safetensors.index.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes()
    other = build_model(tmp_path / "other", preset="tiny", seed=1)
    assert _weight_bytes(other) != _weight_bytes(model_dir)


@pytest.mark.timeout(60)
def test_index_covers_every_tensor_and_splits_layers(model_dir):
    import mlx.core as mx

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {k: f.name for f in model_dir.glob("*.safetensors") for k in mx.load(str(f))}
    assert stored == index
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    first = index["model.layers.0.input_layernorm.weight"]
    last = index[f"model.layers.{n_layers - 1}.input_layernorm.weight"]
    assert len(set(index.values())) >= 2 and first != last


@pytest.mark.timeout(60)
def test_build_is_idempotent_and_force_rebuilds(tmp_path, capsys):
    d = tmp_path / "m"
    assert main([str(d)]) == 0
    assert capsys.readouterr().out.strip() == str(d.resolve())
    stamp_mtime = (d / STAMP).stat().st_mtime_ns
    assert main([str(d)]) == 0
    assert (d / STAMP).stat().st_mtime_ns == stamp_mtime
    assert main([str(d), "--force"]) == 0
    assert (d / STAMP).stat().st_mtime_ns != stamp_mtime
    # A different seed replaces our own earlier build.
    assert main([str(d), "--seed", "3"]) == 0
    assert is_complete(d, "tiny", 3) and not is_complete(d, "tiny", 0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


@pytest.mark.timeout(60)
def test_refuses_foreign_directory_without_force(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("precious")
    with pytest.raises(ModelDirError):
        build_model(d)
    assert main([str(d)]) == 2
    assert (d / "notes.txt").read_text() == "precious"
    build_model(d, force=True)
    assert is_complete(d) and not (d / "notes.txt").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "text", ["Hello, world! The cat reads 42 letters.", "héllo wörld ✓", "日本語 🙂\ttab\nnewline"]
)
def test_tokenizer_round_trips(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(ids) == text


@pytest.mark.timeout(60)
def test_transformers_and_tokenizers_agree(model_dir, hf_tokenizer):
    # transformers 5 rebuilds a qwen2 tokenizer's pipeline (Qwen2Tokenizer); ours must be
    # the same pipeline, or code using `tokenizers` directly would see other ids.
    from tokenizers import Tokenizer

    from models.tinymodel.corpus import corpus

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = corpus()[:200] + ["<|im_start|>user\nhi<|im_end|>", "<tool_call>{}</tool_call>"]
    for text in texts + ["The cat's 12345 dogs  and  \n\n x", "日本語 🙂"]:
        assert hf_tokenizer.encode(text, add_special_tokens=False) == raw.encode(text).ids, text


@pytest.mark.timeout(60)
def test_chat_template_generation_prompt(hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == hf_tokenizer.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.timeout(60)
def test_chat_template_renders_tools_and_tool_calls(hf_tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = hf_tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "get_weather" in text.split("<|im_end|>")[0]  # listed in the system block
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.timeout(60)
def test_mlx_lm_wrapper_sees_eos_ids_and_tool_calling(loaded, hf_tokenizer):
    _, tokenizer = loaded
    im_end, eot = (hf_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert tokenizer.eos_token_ids == {im_end, eot}
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    assert len(tokenizer.tool_call_start_tokens) == 1  # one token, like Qwen2.5


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_divide_for_tp2_and_pp2(name):
    p = PRESETS[name]
    assert p.num_attention_heads % 2 == 0 and p.num_key_value_heads % 2 == 0
    assert p.intermediate_size % 2 == 0 and p.num_hidden_layers % 2 == 0
    assert p.hidden_size % p.num_attention_heads == 0
    assert p.num_attention_heads % p.num_key_value_heads == 0
