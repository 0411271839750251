"""OpenAI chat and completion requests → the internal request (internal_request.py).

What spans two fields and needs no model is checked here (top_logprobs needs logprobs;
completions' logprobs with echo); the rest waits for the model (request_path.admit)."""

from __future__ import annotations

from common import request_params
from services.gateway.core.errors import ApiError
from services.gateway.core.internal_request import (
    NO_LOGPROBS,
    ChatInput,
    GenerationRequest,
    TextInput,
    function_tool,
    stop_list,
    turn,
)
from services.gateway.openai.schemas import ChatMessage, ChatRequest, CompletionRequest


def _bad(param: str, text: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"invalid value for '{param}': {text}" if code == "invalid_value"
                    else text, param=param, code=code)


def chat_turn(m: ChatMessage) -> dict:
    content = ("".join(p.text or "" for p in m.content) if isinstance(m.content, list)
               else m.content)
    return turn(m.role, content, name=m.name, tool_calls=m.tool_calls,
                tool_call_id=m.tool_call_id, reasoning_content=m.reasoning_content)


def from_chat(req: ChatRequest) -> GenerationRequest:
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs", "requires 'logprobs': true")
    tools = [function_tool(t.function.name, t.function.parameters, t.function.description,
                           t.function.strict) for t in req.tools or []]
    return GenerationRequest(
        model=req.model, n=req.n or 1, max_tokens=req.limit(), stops=stop_list(req.stop),
        input=ChatInput([chat_turn(m) for m in req.messages], tools or None,
                        dict(req.chat_template_kwargs or {}), req.reasoning_effort),
        params=request_params.given(req, request_params.CHAT),
        logprobs=(req.top_logprobs or 0) if req.logprobs else NO_LOGPROBS,
        tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
        response_format=req.response_format)


def from_completion(req: CompletionRequest) -> GenerationRequest:
    if req.logprobs is not None and req.echo:
        raise _bad("logprobs", "'logprobs' with 'echo' is not supported: prompt tokens have "
                   "no logprobs here", "unsupported_value")
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str | list):
        p = p[0]  # a one-element list (openai_schemas refuses more)
    text_input = (TextInput(text=p, echo=bool(req.echo)) if isinstance(p, str)
                  else TextInput(ids=list(p), echo=bool(req.echo)))  # type: ignore[arg-type]
    return GenerationRequest(
        model=req.model, n=req.n or 1, max_tokens=req.limit(), stops=stop_list(req.stop),
        input=text_input, params=request_params.given(req, request_params.COMPLETIONS),
        logprobs=NO_LOGPROBS if req.logprobs is None else req.logprobs)
