"""The gateway: the OpenAI-compatible HTTP API and the admin API (`lockstep gateway`).

Map — which module owns which behaviour of DESIGN.md (§8 HTTP API, §6 cancellation).
Wiring, /health, /ready (readiness: serving, tokenizer loaded, canary fresh, view not
stale) and the body cap: `app`; the OpenAI endpoints: `openai_routes`, their request
schemas and validation `openai_schemas`, every request field honoured / harmless /
refused in one table `request_fields`, `n` choices merged `choices`; errors in OpenAI's shape `errors`, the 500
catch-all `catch_all`. Input bounds (body, JSON depth, surrogates, counts, prompt bytes
before tokenizing, work off the loop): `app` (body), `jsonguard`, `openai_schemas`,
`prompts`, `prepare_pool`. From rank 0's chunks to what the client sees: `generation`
(detokenize → stop strings → content / reasoning / tool calls, read timeout, rank error
codes → HTTP in one table), with `detok`, `stops`, `output_parser` (mlx-lm's state
machine), `toolcalls` (mlx-lm's parsers, validated), `chat_format` (the model's markers
and parser, as mlx-lm reads them), `tokenizers` (loaded once per model); bodies
and SSE, and abort on client disconnect (a listener next to the writer): `streaming`.
One deployment's request channel to rank 0 — admission (`max_inflight`, 429), ABORT on
release, drains, orphans reaped, the active counter: `request_channel`; one request's
stream (its chunks in order, what they said): `request_stream`; the 429 and 503 a
channel answers instead of a stream: `refusals`; an admitted request's release, its
outcome counted once, its client leaving: `request_path.Admitted`; rank 0 lost,
seen by the gateway itself (socket monitor, heartbeats) so its streams fail at once
without waiting for the supervisor: `rank_link`. The supervisor (admin calls, events,
deployments, one channel per serving deployment): `cluster_view`. Admin API (status,
deploy, unload, abort-all with evidence, reap): `admin_api`. Metrics: `metrics`.
Settings: `settings`. Anthropic's Messages API (/v1/messages, count_tokens), a
translation onto the same request path (`request_path.admit`): its field table,
validation and translation `anthropic_schemas`, its bodies, event stream and error
shape `anthropic_render`, its routes `anthropic_routes`. OpenAI's Responses API
(/v1/responses), the same way: `responses_schemas` (field table, validation),
`responses_translate` (onto a chat request), `responses_stream` (output items, typed events), `response_store` (the
bounded store behind `previous_response_id`), `responses_routes`.
"""
