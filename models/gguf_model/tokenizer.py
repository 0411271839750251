"""tokenizer.json + tokenizer_config.json from a GGUF's byte-level BPE metadata.

GGUF keeps the tokens, merges and token types (`tokenizer.ggml.*`) and names its
pre-tokenizer (`tokenizer.ggml.pre`); the split rules of that name are llama.cpp's
(llama-vocab.cpp), written here as the Hugging Face pipeline that produced the GGUF.
Control tokens (type 3) become special added tokens, as in the original tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

TOKEN_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
TOKEN_USER_DEFINED = 4

# Llama 3's split (llama.cpp "llama-bpe"); the tokenizer.json of those models carries it.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class UnsupportedTokenizer(Exception):
    """A GGUF tokenizer this converter does not rebuild (e.g. SentencePiece 'llama')."""


def _pre_tokenizer(pre: str):
    if pre == "smollm":  # SmolLM's tokenizer.json: single digits, then GPT-2's split
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    raise UnsupportedTokenizer(f"tokenizer.ggml.pre {pre!r} is not supported "
                               "(supported: smollm, llama-bpe, gpt2)")


def _meta_int(meta: dict, key: str) -> int | None:
    v = meta.get(key)
    return None if v is None else int(v.item() if hasattr(v, "item") else v)


def _meta_bool(meta: dict, key: str, default: bool) -> bool:
    v = meta.get(key)
    return default if v is None else bool(v.item() if hasattr(v, "item") else v)


def special_ids(meta: dict) -> dict[str, int | None]:
    return {name: _meta_int(meta, f"tokenizer.ggml.{name}_token_id")
            for name in ("bos", "eos", "padding", "unknown")}


def build_tokenizer(meta: dict) -> tuple[Tokenizer, list[int]]:
    """The `tokenizers` pipeline and the ids of its special (control) tokens."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedTokenizer(f"tokenizer.ggml.model {kind!r} is not supported "
                                   "(only byte-level BPE, 'gpt2')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None else [int(t) for t in types.tolist()]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UnsupportedTokenizer("tokenizer.ggml.tokens has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    control = [i for i, t in enumerate(types) if t == TOKEN_CONTROL]
    user = [i for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
    # Added in id order; each is already in the vocab, so ids do not move.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in control])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    for i in control + user:
        assert tok.token_to_id(tokens[i]) == i, tokens[i]
    return tok, control


def write_tokenizer(out_dir: Path, meta: dict, context: int | None) -> dict[str, int | None]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the
    bos/eos/padding/unknown ids for config.json."""
    tok, control = build_tokenizer(meta)
    tok.save(str(out_dir / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    ids = special_ids(meta)

    def name(key: str) -> str | None:
        i = ids[key]
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    added = {str(i): {"content": tokens[i], "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True} for i in control}
    extra = [t for t in (name("bos"), name("eos")) if t is not None]
    config = {
        # tokenizer.json as written, not a model-specific class's own split rules
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": list(dict.fromkeys(extra)),
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "pad_token": name("padding"),
        "unk_token": name("unknown"),
        "add_bos_token": _meta_bool(meta, "tokenizer.ggml.add_bos_token", False),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context or 8192,
        "vocab_size": len(tokens),
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    special_map = {k: v for k, v in (
        ("bos_token", name("bos")), ("eos_token", name("eos")), ("pad_token", name("padding")),
        ("unk_token", name("unknown")),
        ("additional_special_tokens", config["additional_special_tokens"])) if v}
    for fname, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out_dir / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    return ids
