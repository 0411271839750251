"""The rank service: one MLX process per rank (`python -m services.rank --spec FILE`).

Map — which module owns which behaviour of DESIGN.md. Start-up to the serve release
(§5 launch, barrier): `boot`, with `warmup` (the generation every rank runs after the
load so the first request pays nothing the canary did not). Threads: the main thread runs the batch (`engine`,
`sampling`) through `leader` (rank 0: requests in, one plan per step out, tokens back)
or `follower` (ranks 1..N-1: apply plans in order, fail closed on any divergence), both
on `loop` (what they share: the inbox, cancel epochs and acks, one step, every way
out); the I/O thread (`io`) owns every socket, with `plan_channel` (the plan socket's
two ends: join, fan-out, replay and fetch, probes), `auth` (mutual authentication),
`control_intake` (control believed after the supervisor's proof, held until then),
`intake` (listener budgets), `streams` (rank 0's ledger: the one owner of open streams
and builder of every `Tokens` chunk); the watchdog thread is `watchdog_thread`, its
pure decisions `watchdogs` (§7). Between threads: `events` (I/O → main) and `outbox`
(any thread → I/O), woken by `waker`. Plans (§5 step plans): built and applied in
`leader`/`follower`, carried by `plan_channel`, sized and ordered by `planwire`.
Cancellation (§6): aborts and cancel epochs folded into plans in `leader`, acked in
`loop`; the abort stage ends streams in `streams`. Removal records (§4): `removals`.
Leaving: phase, marker and every exit (clean, hard, escape hatch) in `runtime`, what
they share (memory released, the kernel alarm, logs flushed) in `process_exit`; typed
causes of failure in `errors`. Also: `env` (the rank's environment), `limits` (fd
limit), `seams` (test seams, off unless the spec enables them).
"""
