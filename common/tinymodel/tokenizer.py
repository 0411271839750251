"""A byte-level BPE tokenizer trained locally, with a Qwen-style ChatML template.

Nothing is downloaded: the corpus is generated here from fixed word lists with a fixed
seed, so the same code always trains the same tokenizer. Byte-level BPE (GPT-2/Qwen2
style) means every string, ASCII or not, encodes and decodes back exactly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Added but not special (as in Qwen2.5), so a tool call start is one token and
# mlx-lm's "json_tools" parser is inferred from the template.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

# Qwen2.5's template, with tool-call arguments passed through when they already are a
# JSON string (OpenAI clients send them that way) instead of being encoded twice.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SUBJECTS = [
    "the cat", "a small dog", "my neighbour", "the old server", "every request", "the river",
    "our team", "a quiet student", "the weather", "this model", "the red train", "a farmer",
    "the library", "each worker", "the gateway", "a tired engineer", "the orchestra",
    "the city council", "a curious child", "the night shift", "the blue bird", "a robot",
]
_VERBS = [
    "reads", "writes", "finds", "builds", "carries", "watches", "follows", "answers",
    "cancels", "restarts", "measures", "paints", "remembers", "forgets", "sends", "receives",
    "opens", "closes", "counts", "explains", "repairs", "visits", "plays", "cooks",
]
_OBJECTS = [
    "a long letter", "the morning paper", "three green apples", "the broken clock",
    "a new plan", "every message", "the final answer", "a warm cup of tea", "the map",
    "two tickets", "the garden gate", "a short story", "the missing key", "a heavy box",
    "the evening news", "a list of numbers", "the quiet song", "a bright lamp",
]
_PLACES = [
    "in the kitchen", "at the station", "near the old bridge", "on the hill",
    "before lunch", "after midnight", "during the storm", "by the window", "at home",
    "in the office", "under the table", "across the street", "in a small town",
]
_CONNECTORS = ["because", "although", "while", "and then", "so", "but", "until", "when"]
_QUESTIONS = [
    "What time is it?", "Where is the nearest station?", "How do I reset my password?",
    "Can you help me write a poem?", "Why is the sky blue?", "Who wrote this book?",
    "Which road goes to the sea?", "How many days are in a week?", "What is the weather like?",
    "Could you summarise this article?", "Is the server running?", "What does this error mean?",
]
_ANSWERS = [
    "Sure, here is a short answer.", "I am not sure, but I can try.", "Yes, of course.",
    "No, that is not correct.", "Let me think about it step by step.", "Here is the result:",
    "The answer is forty two.", "It depends on the context.", "Thank you for asking!",
]
_FOREIGN = [
    "héllo wörld", "café au lait", "naïve façade", "straße", "über", "niño", "crème brûlée",
    "año nuevo", "smörgåsbord", "déjà vu", "Grüße", "fiancée", "✓ done", "→ next", "€ 12,50",
]
_CODE = [
    "def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
    "if x > 0:\n    x -= 1\nelse:\n    x = 0\n", "import json\ndata = json.loads(text)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "while True:\n    break\n", "result = [n * n for n in numbers if n % 2 == 0]\n",
]
_TOOLS = ["get_weather", "search", "send_email", "add_numbers", "lookup_user", "get_time"]
_ARG_KEYS = ["city", "query", "to", "a", "b", "user_id", "timezone", "limit"]


def corpus(n_sentences: int = 600) -> list[str]:
    """A fixed, varied English-ish corpus: prose, dialogue, code, JSON and tool calls."""
    rng = random.Random(20240601)  # fixed: the tokenizer must not depend on the model seed
    out: list[str] = []
    for i in range(n_sentences):
        kind = i % 8
        s, v, o, p = (rng.choice(x) for x in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES))
        if kind in (0, 1, 2):
            line = f"{s.capitalize()} {v} {o} {p}."
            if rng.random() < 0.5:
                s2, v2, o2 = (rng.choice(x) for x in (_SUBJECTS, _VERBS, _OBJECTS))
                line = f"{line[:-1]} {rng.choice(_CONNECTORS)} {s2} {v2} {o2}."
        elif kind == 3:
            line = f"User: {rng.choice(_QUESTIONS)}\nAssistant: {rng.choice(_ANSWERS)}"
        elif kind == 4:
            n = rng.randint(0, 100000)
            line = f"On day {rng.randint(1, 31)}, {s} {v} {n} items ({n / 7:.2f} per day)."
        elif kind == 5:
            line = rng.choice(_CODE)
        elif kind == 6:
            args = {k: rng.choice([rng.randint(0, 99), rng.choice(_OBJECTS)])
                    for k in rng.sample(_ARG_KEYS, 2)}
            call = json.dumps({"name": rng.choice(_TOOLS), "arguments": args})
            line = f"<tool_call>\n{call}\n</tool_call>"
        else:
            line = f"{rng.choice(_FOREIGN)}, {s} {v} {o}!"
        out.append(line)
    return out


def train_tokenizer(vocab_size: int = 1536) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int = 1536) -> dict[str, int]:
    """Write tokenizer files into out_dir; return the ids the model config needs."""
    tok = train_tokenizer(vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + TOOL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
    }
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    return {"vocab_size": tok.get_vocab_size(), **ids}
