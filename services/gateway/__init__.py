"""The gateway: the OpenAI- and Anthropic-compatible HTTP APIs and the admin API
(`lockstep gateway`), laid out by what it serves (docs/design.md, "Parts and arrows").

Map — which module owns which behaviour of DESIGN.md (§8 HTTP API, §6 cancellation):

- `app`: wiring, /health, /ready (serving, tokenizer loaded, canary fresh, view not
  stale), the body cap, errors in each API's shape; `catch_all`: the 500 catch-all.
- `core/`, what every API shares. `internal_request`: the one typed request every API
  translates into. `request_path`: admission (pick, tokenize, grammar, sampling,
  GENERATE) and an admitted request's release, its outcome counted once, its client
  leaving. `request_body`, `jsonguard`, `prompts`, `prepare_pool`: input bounds (JSON
  depth, surrogates, counts, prompt bytes before tokenizing, work off the loop).
  `field_support`: the row type and the one refusal loop of every API's field table.
  `auth`: API keys. `generation` (detokenize → stop strings → content / reasoning / tool
  calls, read timeout, rank error codes → HTTP), with `detok`, `stops`, `output_parser`,
  `toolcalls`, `chat_format`, `tokenizers`; `streaming`: bodies and SSE, abort on client
  disconnect. `request_channel` (admission bound, ABORT on release, drains, orphans),
  `request_stream`, `refusals`, `rank_link` (rank 0 lost, seen at once), `resume`,
  `router`, `cluster_view` (the supervisor: admin calls, events, deployments),
  `metrics`, `settings`.
- `openai/`: /v1/chat/completions, /v1/completions, /v1/models — `schemas`, `fields`
  (every field honoured / harmless / refused), `translate`, `routes`.
- `responses/`: /v1/responses — `schemas`, `translate`, `stream` (output items, typed
  events), `background`, `store` (behind `previous_response_id`), `items`, `routes`.
- `anthropic/`: /v1/messages and count_tokens — `schemas`, `translate`, `render` (bodies,
  event stream, error shape), `routes`.
- `admin/`: the admin API (`api`: status, deploy, unload, abort-all with evidence, reap)
  and the console (`console_api`, its page in `console/`).
"""
