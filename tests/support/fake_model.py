"""A model directory for supervisors that start fake ranks: no weights, just the
config.json (and weight index) the supervisor's topology check reads before any launch
(services/supervisor/topology.py). The shape is the tiny preset's: 4 heads, 2 KV heads,
MLP 256, 4 layers, so tp 1, 2 and pp 1..4 are accepted."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 256, "num_hidden_layers": 4, "hidden_size": 64}


def fake_model_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    return d
