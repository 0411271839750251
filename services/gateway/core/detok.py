"""Tokenizer side of the gateway: chat template, encoding, incremental detokenizing.

Rank 0 deals in token ids only; all text lives here. `Detokenizer` turns a growing list
of ids into text deltas without ever emitting half a UTF-8 character: the byte-level
BPE decoder yields U+FFFD for an incomplete sequence, so a delta ending in it is held
back until the next ids complete it (the prefix/read-offset scheme of TGI and vLLM).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.gateway.core import tool_prompt
from services.gateway.core.chat_format import ChatFormat, load_format

REPLACEMENT = "\ufffd"
# A UTF-8 character has at most 4 bytes; past this many pending ids the bytes are
# invalid for good and are emitted as U+FFFD rather than held forever.
MAX_PENDING = 6


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it."""


@dataclass
class ModelTokenizer:
    """One model's tokenizer, loaded once per model directory."""

    path: Path
    hf: Any  # transformers PreTrainedTokenizer(Fast)
    eos_ids: list[int]
    context_len: int | None
    fmt: ChatFormat = field(default_factory=ChatFormat)
    # Special tokens left out of the text: all but the format's markers (a `<think>` or
    # tool-call start that is a special token must reach the output parser).
    drop_ids: frozenset[int] = frozenset()

    @property
    def fast(self) -> Any:
        """The Rust tokenizer when there is one (decode without Python overhead)."""
        return getattr(self.hf, "backend_tokenizer", None) or getattr(self.hf, "_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self.drop_ids:
            ids = [i for i in ids if i not in self.drop_ids]
        fast = self.fast
        if fast is not None:
            return fast.decode(ids, skip_special_tokens=not self.drop_ids)
        return self.hf.decode(ids, skip_special_tokens=not self.drop_ids)

    def render_chat(self, messages: list[dict], tools: list[dict] | None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template applied: the prompt as text (tokenize it with `encode`).
        Rendered as mlx-lm renders it (its wrapper: `enable_thinking` defaults to whether
        the model thinks, and is renamed for templates that call it otherwise)."""
        w = self.fmt.wrapper
        if not getattr(self.hf, "chat_template", None) and not (w and w.has_chat_template):
            raise ChatTemplateError(f"model {self.path.name} has no chat template; use /v1/completions")
        render = w.apply_chat_template if w is not None else self.hf.apply_chat_template
        if self.fmt.gateway_tools:  # a template without tools: they are written as text
            messages, tools = tool_prompt.fold(messages, tools), None
        try:
            return render(messages, tools=tools or None, add_generation_prompt=True,
                          tokenize=False, **(template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - jinja errors of every kind
            raise ChatTemplateError(f"chat template failed: {exc}") from None

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        return self.encode(self.render_chat(messages, tools))

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.decode, self.token_bytes())

    def token_bytes(self) -> list[bytes | None] | None:
        """Raw bytes of every token id for a byte-level BPE (None: not byte-level)."""
        if not hasattr(self, "_bytes"):
            self._bytes = _byte_level_table(self.fast, self.drop_ids)
        return self._bytes


def _gpt2_byte_decoder() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _byte_level_table(fast: Any, drop_ids: frozenset[int] = frozenset()) -> list[bytes | None] | None:
    """Token id → the bytes it decodes to; added tokens map to their UTF-8 content
    (special ones to nothing, unless kept: not in `drop_ids` when that is given)."""
    if fast is None:
        return None
    try:
        spec = json.loads(fast.to_str())
    except Exception:  # noqa: BLE001 - an unusual tokenizer: fall back to the heuristic
        return None
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        return None
    dec = _gpt2_byte_decoder()
    vocab = fast.get_vocab(with_added_tokens=True)
    added = {t["content"]: t.get("special", False) for t in spec.get("added_tokens", [])}
    table: list[bytes | None] = [None] * (max(vocab.values()) + 1)
    for piece, i in vocab.items():
        if piece in added:
            dropped = i in drop_ids if drop_ids else added[piece]
            table[i] = b"" if dropped else piece.encode()
        else:
            try:
                table[i] = bytes(dec[c] for c in piece)
            except KeyError:
                table[i] = None
    return table


def incomplete_utf8_tail(b: bytes) -> bool:
    """True if `b` ends inside a valid multi-byte UTF-8 character (more bytes may
    complete it); False if it ends on a boundary or in bytes that can never decode."""
    for k in range(1, min(4, len(b)) + 1):
        if b[-k] & 0xC0 != 0x80:  # the last lead byte
            try:
                b[-k:].decode("utf-8")
            except UnicodeDecodeError as exc:
                return exc.reason == "unexpected end of data" and exc.start == 0
            return False
    return False


_CACHE: dict[Path, ModelTokenizer] = {}
# Held for a whole load: the first `from transformers import AutoTokenizer` is a lazy
# module import that fails ("cannot import name") when two threads race through it.
_LOCK = threading.Lock()


def load_tokenizer(path: str | Path) -> ModelTokenizer:
    """Load (once) the tokenizer of a model directory, with its eos ids and context."""
    p = Path(path).expanduser().resolve()
    with _LOCK:
        hit = _CACHE.get(p)
        if hit is None:
            hit = _CACHE[p] = _load(p)
        return hit


def _load(p: Path) -> ModelTokenizer:
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    wrapper, fmt = load_format(p)  # mlx-lm's own reading of the tokenizer and template
    hf = wrapper._tokenizer
    eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            val = json.loads((p / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        eos += val if isinstance(val, list) else ([val] if isinstance(val, int) else [])
    if isinstance(hf.eos_token_id, int):
        eos.append(hf.eos_token_id)
    ctx = None
    try:
        ctx = json.loads((p / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        pass
    tok = ModelTokenizer(p, hf, sorted(set(eos)), ctx if isinstance(ctx, int) else None, fmt,
                         _drop_ids(hf, fmt))
    tok.token_bytes()  # built here, in the loading thread, not on a first request
    return tok


def _drop_ids(hf: Any, fmt: ChatFormat) -> frozenset[int]:
    """Special added tokens that are not (part of) one of the format's markers; empty
    when no marker is a special token (then decoding skips special tokens as usual)."""
    markers = fmt.markers()
    special = {i: t.content for i, t in getattr(hf, "added_tokens_decoder", {}).items()
               if getattr(t, "special", False)}
    kept = {i for i, text in special.items() if any(text in m for m in markers)}
    return frozenset(special) - kept if kept else frozenset()


class Detokenizer:
    """Incremental detokenizer: `add(ids)` returns the new, complete text."""

    def __init__(self, decode, token_bytes: list[bytes | None] | None = None) -> None:
        self._decode = decode
        self._bytes = token_bytes
        self.ids: list[int] = []
        self._prefix = 0  # ids before this are settled text
        self._read = 0  # text of ids[_prefix:_read] has been emitted
        self.text_len = 0

    def add(self, ids: list[int]) -> str:
        if not ids:
            return ""
        self.ids.extend(ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) <= len(prefix_text):
            return ""  # nothing visible yet (special tokens): wait
        if new_text.endswith(REPLACEMENT) and self._may_complete():
            return ""  # an incomplete UTF-8 sequence: wait for the rest of its bytes
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text_len += len(delta)
        return delta

    def _may_complete(self) -> bool:
        tail = self.ids[max(self._read, len(self.ids) - 4):]
        if self._bytes is not None:
            try:
                raw = b"".join(self._bytes[t] for t in tail)  # type: ignore[misc]
            except (IndexError, TypeError):
                raw = None
            if raw is not None:
                return incomplete_utf8_tail(raw)
        return len(self.ids) - self._read < MAX_PENDING  # not byte-level: bounded wait

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (replacement chars stay)."""
        if self._read >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        new_text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        delta = new_text[len(prefix_text):]
        self.text_len += len(delta)
        return delta
