"""A llama-family GGUF → an mlx-lm model directory (config, safetensors shards, tokenizer).

`mx.load(gguf)` gives the matrices as MLX affine-quantized triples (weight, scales,
biases); they are kept as they are (`weights="quantized"`, the fast form on Metal) or
dequantized to float32 (the fast form on the CPU, where MLX's quantized matmul is slow).
llama.cpp stores the q/k rows of each head permuted for its rope; they are permuted back,
so the result is the Hugging Face layout and the config is the checkpoint's own.

The config is written as mlx-lm's `ministral3` by default: Llama with an attention
temperature that is exactly 1 at `llama_4_scaling_beta` 0, so the same computation (tests
prove the greedy text identical to the `llama` form), and it has both tensor and pipeline
parallelism (mlx-lm's llama only the former). Not Qwen2 with zero biases: transformers
loads every model_type qwen2 tokenizer as Qwen2Tokenizer, whose split rules are not the
GGUF's (it tokenizes "\n\n" differently).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .tokenizer import write_tokenizer

ARCHS = ("ministral3", "llama")
WEIGHTS = ("float32", "quantized")
LAYER_SHARDS = 2  # layer files (plus one for embeddings and norm), so PP loads only its own

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


class GGUFError(Exception):
    """The GGUF is not a llama-family model this converter maps."""


def default_weights() -> str:
    return "quantized" if mx.metal.is_available() else "float32"


def _hf_name(gguf_base: str) -> str:
    if gguf_base in _TOP_NAMES:
        return _TOP_NAMES[gguf_base]
    parts = gguf_base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    raise GGUFError(f"unexpected tensor {gguf_base!r}")


def _scalar(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    if v is None:
        raise GGUFError(f"metadata {key!r} is missing")
    return v.item() if hasattr(v, "item") else v


def hyperparams(meta: dict) -> dict:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"general.architecture {arch!r}: only 'llama' is supported")
    a = "llama."
    n_heads = int(_scalar(meta, a + "attention.head_count"))
    hidden = int(_scalar(meta, a + "embedding_length"))
    rope_dim = int(_scalar(meta, a + "rope.dimension_count", hidden // n_heads))
    if rope_dim != hidden // n_heads:
        raise GGUFError(f"rope over {rope_dim} of {hidden // n_heads} head dims: unsupported")
    if meta.get(a + "rope.scaling.type") not in (None, "none"):
        raise GGUFError("rope scaling is not supported")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, a + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_scalar(meta, a + "attention.head_count_kv", n_heads)),
        "intermediate_size": int(_scalar(meta, a + "feed_forward_length")),
        "rms_norm_eps": float(f"{_scalar(meta, a + 'attention.layer_norm_rms_epsilon'):.7g}"),
        "rope_theta": float(f"{_scalar(meta, a + 'rope.freq_base', 10000.0):.7g}"),
        "max_position_embeddings": int(_scalar(meta, a + "context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
    }


def _unpermute(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py `permute`): rows of a
    head go from interleaved pairs back to two halves. Rows only, so a quantized weight's
    packed rows, scales and biases all move alike."""
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)


def _bits(triple: dict[str, mx.array]) -> tuple[int, int]:
    """(bits, group_size) of an MLX affine triple, from the shapes alone."""
    w, s = triple["weight"], triple["scales"]
    for group in (32, 64, 128):
        cols = s.shape[-1] * group
        if (w.shape[-1] * 32) % cols == 0 and (w.shape[-1] * 32) // cols in (2, 3, 4, 5, 6, 8):
            return (w.shape[-1] * 32) // cols, group
    raise GGUFError(f"cannot tell the bit width of a {w.shape} weight with {s.shape} scales")


def convert_tensors(raw: dict[str, mx.array], hp: dict, weights: str, arch: str
                    ) -> tuple[dict[str, mx.array], dict]:
    """(HF-named tensors, the config's "quantization" entry or {})."""
    grouped: dict[str, dict[str, mx.array]] = {}
    for key, arr in raw.items():
        base, _, kind = key.rpartition(".")
        grouped.setdefault(base, {})[kind] = arr
    out: dict[str, mx.array] = {}
    quant: dict = {}
    for base, parts in sorted(grouped.items()):
        name = _hf_name(base)
        if base.endswith(".attn_q") or base.endswith(".attn_k"):
            heads = hp["num_attention_heads"] if base.endswith("q") else hp["num_key_value_heads"]
            parts = {k: _unpermute(v, heads) for k, v in parts.items()}
        if "scales" in parts:
            bits, group = _bits(parts)
            if weights == "float32":
                w = mx.dequantize(parts["weight"], parts["scales"], parts["biases"],
                                  group_size=group, bits=bits)
                out[f"{name}.weight"] = w.astype(mx.float32)
            else:
                for k in ("weight", "scales", "biases"):
                    out[f"{name}.{k}"] = parts[k]
                quant[name] = {"group_size": group, "bits": bits}
        else:
            out[f"{name}.weight"] = parts["weight"].astype(mx.float32)
    if quant:
        # the most common (bits, group) is the default; the rest are per-layer entries
        counts: dict[tuple[int, int], int] = {}
        for q in quant.values():
            counts[(q["bits"], q["group_size"])] = counts.get((q["bits"], q["group_size"]), 0) + 1
        bits, group = max(counts, key=counts.get)
        quant = {"group_size": group, "bits": bits,
                 **{k: v for k, v in sorted(quant.items())
                    if (v["bits"], v["group_size"]) != (bits, group)}}
    return out, quant


def model_config(hp: dict, arch: str, ids: dict, tied: bool, quant: dict, weights: str) -> dict:
    cfg = {
        "architectures": ["Ministral3ForCausalLM" if arch == "ministral3"
                          else "LlamaForCausalLM"],
        "model_type": arch,
        **hp,
        "head_dim": hp["hidden_size"] // hp["num_attention_heads"],
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["padding"],
        "torch_dtype": "float32" if weights == "float32" else "float16",
    }
    if arch == "ministral3":
        # beta 0: the attention temperature 1 + beta * log(...) is 1, i.e. plain Llama
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": hp["rope_theta"],
                                  "llama_4_scaling_beta": 0.0,
                                  "original_max_position_embeddings":
                                      hp["max_position_embeddings"]}
    else:
        cfg.update(attention_bias=False, mlp_bias=False)
    if quant:
        cfg["quantization"] = quant
        cfg["quantization_config"] = quant
    return cfg


def _write_shards(out_dir: Path, tensors: dict[str, mx.array], n_layers: int) -> list[str]:
    n_files = 1 + LAYER_SHARDS
    names = [f"model-{k:05d}-of-{n_files:05d}.safetensors" for k in range(1, n_files + 1)]
    per = -(-n_layers // LAYER_SHARDS)
    groups: list[dict[str, mx.array]] = [{} for _ in names]
    for k, v in tensors.items():
        if k.startswith("model.layers."):
            groups[1 + int(k.split(".")[2]) // per][k] = v
        else:
            groups[0][k] = v
    weight_map: dict[str, str] = {}
    total = 0
    for fname, g in zip(names, groups, strict=True):
        mx.save_safetensors(str(out_dir / fname), dict(sorted(g.items())),
                            metadata={"format": "mlx"})
        for k, v in g.items():
            weight_map[k] = fname
            total += v.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_model(out_dir: Path, gguf: Path, weights: str, arch: str) -> dict:
    """Write the model files into out_dir (empty); return a summary for the stamp."""
    if weights not in WEIGHTS or arch not in ARCHS:
        raise ValueError(f"weights {weights!r} / arch {arch!r}")
    with mx.stream(mx.cpu):  # dequantizing is a one-off: the CPU is always there
        raw, meta = mx.load(str(gguf), return_metadata=True)
        hp = hyperparams(meta)
        ids = write_tokenizer(out_dir, meta, hp["max_position_embeddings"])
        tensors, quant = convert_tensors(raw, hp, weights, arch)
        tied = "lm_head.weight" not in tensors
        config = model_config(hp, arch, ids, tied, quant, weights)
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
               "pad_token_id": ids["padding"]}
        (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        shards = _write_shards(out_dir, tensors, hp["num_hidden_layers"])
    return {"name": str(meta.get("general.name", "")), "dims": hp, "shards": shards}
