"""The embedded model's tokenizer turned into a "thinking" model's: `<think>`/`</think>`
added as special tokens, a chat template that opens reasoning in the generation prompt
unless `enable_thinking` is false (as Qwen3's does), and, with `coder`, a template that
names Qwen3-Coder's tool-call format (so mlx-lm infers its qwen3_coder parser). For the
gateway only: the weights are not resized, so ranks cannot serve it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

THINK = ("<think>", "</think>")
OPEN_THINKING = ("{%- if add_generation_prompt and enable_thinking is not false %}"
                 "{{- '<think>\\n' }}{%- endif %}")
CODER_TOOLS = "{#- tool calls: <tool_call>\n<function=NAME>\n<parameter=ARG> -#}"


def thinker_model(tiny: Path, dest: Path, *, coder: bool = False) -> Path:
    shutil.copytree(tiny, dest)
    t = Tokenizer.from_file(str(dest / "tokenizer.json"))
    t.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in THINK])
    t.save(str(dest / "tokenizer.json"))
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    for m in THINK:
        cfg["added_tokens_decoder"][str(t.token_to_id(m))] = {
            "content": m, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
    cfg["chat_template"] += OPEN_THINKING + (CODER_TOOLS if coder else "")
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest
