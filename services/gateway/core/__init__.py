"""What every API shares: admission, routing, streams, resume, prompts, grammar, sampling."""
