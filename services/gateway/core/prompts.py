"""From a validated request to the prompt's token ids, with every input bounded first.

Synchronous and CPU-bound (chat template, tokenizer): callers run it off the event loop
(`prepare_pool.PreparePool`). Tokenizing costs time and memory per byte, so a prompt is measured
before it is tokenized: its UTF-8 bytes (for chat: the whole rendered template, all
messages and tools) must be under `context × input_bytes_per_token`. Real text averages
3-5 bytes per token (byte-level BPE: English ~4, code ~3, CJK ~2-3), so 8 refuses
nothing that could fit the context, while a 4 MB prompt for a 4k-token model is refused
in microseconds instead of being tokenized into a million ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.core.detok import ChatTemplateError, ModelTokenizer
from services.gateway.core.errors import ApiError
from services.gateway.core.internal_request import ChatInput, GenerationRequest, JsonObject
from services.gateway.core.output_parser import OutputParser

# Arguments the gateway itself passes to the chat template: not the client's to set.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize",
                                    "return_dict", "continue_final_message", "chat_template"})


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    echo: str  # text to echo back (completions with echo), else ""
    in_reasoning: bool = False  # the chat prompt ends inside an open reasoning block


MAX_TOKENS = 2**31 - 1  # the wire's bound on max_tokens: more than any model generates


def token_limit(requested: int | None, default: int, context: int | None,
                prompt_len: int) -> int:
    """The max_tokens sent to rank 0: the request's (else the gateway's default), capped by
    what the context leaves after the prompt, and by the wire's int when the model states
    no context (a max_tokens of 10**20 means "as many as you can", not a 500)."""
    limit = requested or default
    if context:
        limit = min(limit, context - prompt_len)
    return min(limit, MAX_TOKENS)


def byte_limit(tok: ModelTokenizer, bytes_per_token: int) -> int | None:
    """The most prompt bytes worth tokenizing for this model (None: context unknown)."""
    return tok.context_len * bytes_per_token if tok.context_len else None


def _too_long(param: str, nbytes: int, limit: int, tok: ModelTokenizer) -> ApiError:
    return ApiError(400, f"the prompt is {nbytes} bytes; this model's context of "
                    f"{tok.context_len} tokens takes at most {limit} bytes of input",
                    param=param, code="context_length_exceeded")


def prompt_ids(req: GenerationRequest, tok: ModelTokenizer, bytes_per_token: int) -> Prompt:
    limit = byte_limit(tok, bytes_per_token)
    inp = req.input
    if isinstance(inp, ChatInput):
        try:
            text = tok.render_chat(inp.messages, req.tools(), template_kwargs(inp, tok))
        except ChatTemplateError as exc:  # the messages (or the model) do not fit it
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
        n = len(text.encode())
        if limit is not None and n > limit:
            raise _too_long("messages", n, limit, tok)
        return Prompt(tok.encode(text), "", tok.fmt.opens_in_reasoning(text))
    if inp.text is not None:
        n = len(inp.text.encode())
        if limit is not None and n > limit:
            raise _too_long("prompt", n, limit, tok)
        return Prompt(tok.encode(inp.text), inp.text if inp.echo else "")
    ids = inp.ids or []
    ctx = tok.context_len
    if ctx and len(ids) >= ctx:  # checked before the ids are looked at one by one
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {ctx}",
                       param="prompt", code="context_length_exceeded")
    vocab = len(tok.hf)
    if any(not 0 <= t < vocab for t in ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt",
                       code="invalid_value")
    return Prompt(list(ids), tok.decode(list(ids)) if inp.echo else "")


def template_kwargs(inp: ChatInput, tok: ModelTokenizer) -> JsonObject:
    """`chat_template_kwargs` (an object, validated by the schema; the gateway's own
    arguments refused by name) and `reasoning_effort`, which only a template that reads
    it can honour."""
    kw = dict(inp.template_kwargs)
    for k in kw:
        if k in RESERVED_TEMPLATE_ARGS:
            raise ApiError(400, f"chat_template_kwargs.{k}: set by the server, not the request",
                           param=f"chat_template_kwargs.{k}", code="invalid_value")
    if inp.reasoning_effort is not None:
        if "reasoning_effort" not in tok.fmt.template_vars:
            raise ApiError(400, f"reasoning_effort: the chat template of {tok.path.name} does not "
                           "read it", param="reasoning_effort", code="unsupported_value")
        kw.setdefault("reasoning_effort", inp.reasoning_effort)
    return kw


def output_parser(req: GenerationRequest, tok: ModelTokenizer, prompt: Prompt) -> OutputParser:
    """Content, reasoning and (when tools are offered) tool calls, in the model's format."""
    return OutputParser(tok.fmt, tools=req.tools(), tool_names=req.tool_names(),
                        in_reasoning=prompt.in_reasoning)
