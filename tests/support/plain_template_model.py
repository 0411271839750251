"""The embedded model with SmolLM2's chat template: one that prints each message's role
and content and nothing else (no `tools`, no tool calls). The vocabulary and weights are
unchanged, so ranks can serve it; the gateway writes tools into its prompt itself
(services/gateway/core/tool_prompt.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# HuggingFaceTB/SmolLM2-135M-Instruct's tokenizer_config.json chat_template, verbatim.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


def plain_template_model(tiny: Path, dest: Path) -> Path:
    shutil.copytree(tiny, dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = SMOLLM2_TEMPLATE
    cfg.pop("tool_parser_type", None)
    cfg_path.write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):  # a template file wins
        (dest / extra).unlink(missing_ok=True)
    return dest
