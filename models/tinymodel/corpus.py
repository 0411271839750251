"""A small built-in training corpus for the tokenizer: prose, dialogue, numbers, code,
JSON tool calls and some non-ASCII text, generated from fixed lists with a fixed seed."""

from __future__ import annotations

import json
import random


def _phrases(s: str) -> list[str]:
    # "|"-separated, so the lists stay compact under the formatter.
    return [p.strip() for p in s.split("|")]


SUBJECTS = _phrases(
    "the cat | a small dog | my neighbour | the old server | every request | the river |"
    " our team | a quiet student | the weather | this model | the red train | a farmer |"
    " the library | each worker | the gateway | a tired engineer | the orchestra |"
    " the city council | a curious child | the night shift | the blue bird | a robot |"
    " the young doctor | my grandmother | the captain | a busy waiter | the scheduler |"
    " the last customer | a famous painter | the fire brigade | your sister | the mayor"
)
VERBS = _phrases(
    "reads | writes | finds | builds | carries | watches | follows | answers | cancels |"
    " restarts | measures | paints | remembers | forgets | sends | receives | opens |"
    " closes | counts | explains | repairs | visits | plays | cooks | borrows | delivers |"
    " describes | forgives | imagines | organises | protects | questions | teaches | wraps"
)
OBJECTS = _phrases(
    "a long letter | the morning paper | three green apples | the broken clock | a new plan |"
    " every message | the final answer | a warm cup of tea | the map | two tickets |"
    " the garden gate | a short story | the missing key | a heavy box | the evening news |"
    " a list of numbers | the quiet song | a bright lamp | the yellow umbrella |"
    " an empty bottle | the wooden chair | a strange noise | the birthday cake |"
    " a difficult question | the annual report | seven silver coins | the mountain path"
)
PLACES = _phrases(
    "in the kitchen | at the station | near the old bridge | on the hill | before lunch |"
    " after midnight | during the storm | by the window | at home | in the office |"
    " under the table | across the street | in a small town | behind the theatre |"
    " beside the harbour | throughout the winter | inside the museum | on Tuesday morning"
)
CONNECTORS = _phrases("because | although | while | and then | so | but | until | when | unless")
QUESTIONS = _phrases(
    "What time is it? | Where is the nearest station? | How do I reset my password? |"
    " Can you help me write a poem? | Why is the sky blue? | Who wrote this book? |"
    " Which road goes to the sea? | How many days are in a week? | What is the weather like? |"
    " Could you summarise this article? | Is the server running? | What does this error mean?"
)
ANSWERS = _phrases(
    "Sure, here is a short answer. | I am not sure, but I can try. | Yes, of course. |"
    " No, that is not correct. | Let me explain it step by step. | Here is the result: |"
    " The answer is forty two. | It depends on the context. | Thank you for asking!"
)
FOREIGN = _phrases(
    "héllo wörld | café au lait | naïve façade | straße | über | niño | crème brûlée |"
    " año nuevo | smörgåsbord | déjà vu | Grüße | fiancée | ✓ done | → next | € 12,50 |"
    " 日本語 | 你好 | привет | γειά σου | 🙂 ok"
)
CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "if x > 0:\n    x -= 1\nelse:\n    x = 0\n",
    "import json\ndata = json.loads(text)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "while True:\n    break\n",
    "result = [n * n for n in numbers if n % 2 == 0]\n",
]
TOOLS = "get_weather search send_email add_numbers lookup_user get_time".split()
ARG_KEYS = "city query to a b user_id timezone limit".split()


def corpus(n_sentences: int = 800) -> list[str]:
    rng = random.Random(20240601)  # fixed: the tokenizer must not depend on the model seed
    out: list[str] = []
    for i in range(n_sentences):
        kind = i % 8
        s, v, o, p = (rng.choice(x) for x in (SUBJECTS, VERBS, OBJECTS, PLACES))
        if kind in (0, 1, 2):
            line = f"{s.capitalize()} {v} {o} {p}."
            if rng.random() < 0.5:
                s2, v2, o2 = (rng.choice(x) for x in (SUBJECTS, VERBS, OBJECTS))
                line = f"{line[:-1]} {rng.choice(CONNECTORS)} {s2} {v2} {o2}."
        elif kind == 3:
            line = f"User: {rng.choice(QUESTIONS)}\nAssistant: {rng.choice(ANSWERS)}"
        elif kind == 4:
            n = rng.randint(0, 100000)
            line = f"On day {rng.randint(1, 31)}, {s} {v} {n} items ({n / 7:.2f} per day)."
        elif kind == 5:
            line = rng.choice(CODE)
        elif kind == 6:
            keys = rng.sample(ARG_KEYS, 2)
            args = {k: rng.choice([rng.randint(0, 99), rng.choice(OBJECTS)]) for k in keys}
            call = json.dumps({"name": rng.choice(TOOLS), "arguments": args})
            line = f"<tool_call>\n{call}\n</tool_call>"
        else:
            line = f"{rng.choice(FOREIGN)}, {s} {v} {o}!"
        out.append(line)
    return out
