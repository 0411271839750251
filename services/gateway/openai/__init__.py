"""OpenAI's chat and text completions (and /v1/models)."""
