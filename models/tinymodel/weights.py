"""Deterministic random Qwen2 weights, sharded by layer, with config.json and an index.

Each tensor is drawn from its own generator seeded by (seed, tensor name), so a tensor's
values never depend on which other tensors exist or the order they are written in.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_target: int  # BPE trainer target; the corpus may yield fewer tokens
    # Init scales. With a small init the residual stream is dominated by the current
    # token's embedding and greedy decoding repeats one token forever; a unit-variance
    # embedding, attention that matters and wide logits keep greedy output varied (and
    # the top-1 margin wide, so TP's different summation order picks the same tokens).
    embed_std: float = 1.0
    attn_gain: float = 2.0  # q/k std = gain / sqrt(hidden): sharper, context-dependent attention
    logit_std: float = 6.0  # target std of the logits (lm_head std = logit_std / sqrt(hidden))


PRESETS: dict[str, Preset] = {
    # Tests: loads and generates in milliseconds.
    "tiny": Preset(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_target=1536,
    ),
    # Benchmarks: big enough that matmuls, not Python, dominate on a 2-core CPU.
    "bench": Preset(
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        vocab_target=1536,
    ),
}

LAYER_SHARDS = 2  # layers are split over this many files, plus one for the rest


def model_config(p: Preset, vocab_size: int, eos_ids: list[int], pad_id: int) -> dict:
    for name in (
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "num_hidden_layers",
    ):
        # TP=2 shards heads and the MLP; PP=2 splits layers.
        assert getattr(p, name) % 2 == 0, name
    assert p.hidden_size % p.num_attention_heads == 0
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "intermediate_size": p.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def _layer_tensors(p: Preset, seed: int, i: int) -> dict[str, np.ndarray]:
    h, inter = p.hidden_size, p.intermediate_size
    head_dim = h // p.num_attention_heads
    q_out, kv_out = p.num_attention_heads * head_dim, p.num_key_value_heads * head_dim
    pre = f"model.layers.{i}."
    spec = {
        "self_attn.q_proj.weight": ((q_out, h), p.attn_gain / h**0.5),
        "self_attn.q_proj.bias": ((q_out,), 0.1),
        "self_attn.k_proj.weight": ((kv_out, h), p.attn_gain / h**0.5),
        "self_attn.k_proj.bias": ((kv_out,), 0.1),
        "self_attn.v_proj.weight": ((kv_out, h), 1 / h**0.5),
        "self_attn.v_proj.bias": ((kv_out,), 0.1),
        "self_attn.o_proj.weight": ((h, q_out), 1 / q_out**0.5),
        "mlp.gate_proj.weight": ((inter, h), 1 / h**0.5),
        "mlp.up_proj.weight": ((inter, h), 1 / h**0.5),
        "mlp.down_proj.weight": ((h, inter), 1 / inter**0.5),
    }
    out = {pre + k: _normal(seed, pre + k, shape, std) for k, (shape, std) in spec.items()}
    out[pre + "input_layernorm.weight"] = np.ones(h, np.float32)
    out[pre + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    return out


def _other_tensors(
    p: Preset, seed: int, vocab_size: int, silent_ids: tuple[int, ...]
) -> dict[str, np.ndarray]:
    h = p.hidden_size
    head = _normal(seed, "lm_head.weight", (vocab_size, h), p.logit_std / h**0.5)
    # A zero row gives logit 0, far below the top logit, so these tokens are never
    # sampled: generations always run to max_tokens and never open a tool call by chance.
    head[list(silent_ids)] = 0.0
    return {
        "model.embed_tokens.weight": _normal(
            seed, "model.embed_tokens.weight", (vocab_size, h), p.embed_std
        ),
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": head,
    }


def write_weights(
    out_dir: Path, p: Preset, seed: int, vocab_size: int, silent_ids: tuple[int, ...] = ()
) -> list[str]:
    """Write the safetensors shards and model.safetensors.index.json; return shard names.

    Shard 1 holds the embeddings, final norm and head (every pipeline stage needs them);
    the others hold contiguous runs of layers, so the index tells mlx-lm's sharded_load
    which files a pipeline stage needs.
    """
    n_files = 1 + LAYER_SHARDS
    names = [f"model-{k:05d}-of-{n_files:05d}.safetensors" for k in range(1, n_files + 1)]
    groups: list[dict[str, np.ndarray]] = [_other_tensors(p, seed, vocab_size, silent_ids)]
    per = -(-p.num_hidden_layers // LAYER_SHARDS)
    for s in range(LAYER_SHARDS):
        g: dict[str, np.ndarray] = {}
        for i in range(s * per, min((s + 1) * per, p.num_hidden_layers)):
            g.update(_layer_tensors(p, seed, i))
        groups.append(g)

    weight_map: dict[str, str] = {}
    total = 0
    for name, g in zip(names, groups, strict=True):
        arrays = {k: mx.array(v) for k, v in sorted(g.items())}
        mx.save_safetensors(str(out_dir / name), arrays, metadata={"format": "mlx"})
        for k, v in g.items():
            weight_map[k] = name
            total += v.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def preset_dict(p: Preset) -> dict:
    return asdict(p)
