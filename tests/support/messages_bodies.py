"""Request bodies the Messages API tests share (tests/unit/test_anthropic_messages.py
walks them against the schema, tests/e2e/test_messages_live.py against a live server)."""

from __future__ import annotations

from common.request_params import MESSAGES
from tests.support.params import samples

BASE = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}

# A sample value per field: honoured and harmless ones must validate (and translate),
# refused ones be a 400 naming the field. (The live walk: tests/e2e/test_messages_live.py.)
SAMPLES = {
    "model": "m", "messages": BASE["messages"], "max_tokens": 8, "system": "be brief",
    "stop_sequences": ["zz"], "stream": True, **samples(MESSAGES),
    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"},
    "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    "metadata": {"user_id": "u"}, "cache_control": {"type": "ephemeral"},
    "service_tier": "auto", "speed": "standard", "inference_geo": "us",
    "diagnostics": {"previous_message_id": "msg_1"}, "user_profile_id": "p",
    "workspace_id": "w", "container": "c1",
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
}


# The shape of what Claude Code 2.1.197 sends as its first request (`claude -p`), captured
# from the real client; its prompt texts and most of its 24 tools are cut short here.
CLAUDE_CODE_FIRST = {
    "model": "m", "max_tokens": 32000, "stream": True,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.1c0; "
                                        "cc_entrypoint=sdk-cli;"},
               {"type": "text", "text": "You are a Claude agent.",
                "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "\nYou are an interactive agent.",
                "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\ncontext\n</system-reminder>\n"},
            {"type": "text", "text": "Say hello", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Available agent types for the Agent tool: ..."}],
    "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
        "properties": {"command": {"type": "string"}}, "required": ["command"],
        "additionalProperties": False}}],
    "metadata": {"user_id": '{"device_id":"d","account_uuid":"","session_id":"s"}'},
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}
