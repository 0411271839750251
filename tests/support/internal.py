"""Reading an internal request (services/gateway/core/internal_request.py) in tests."""

from __future__ import annotations

from services.gateway.core.internal_request import ChatInput, GenerationRequest, tool_name


def messages(req: GenerationRequest) -> list[dict]:
    """The chat messages, each without its empty (None) entries."""
    assert isinstance(req.input, ChatInput)
    return [{k: v for k, v in m.items() if v is not None} for m in req.input.messages]


def tool_names(req: GenerationRequest) -> list[str]:
    assert isinstance(req.input, ChatInput)
    return [tool_name(t) for t in req.input.tools or []]


def functions(req: GenerationRequest) -> list[dict]:
    """Each offered tool's `function` object."""
    assert isinstance(req.input, ChatInput)
    return [t["function"] for t in req.input.tools or []]
