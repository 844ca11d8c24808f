"""The server's default limits, in one place without dependencies (the CLI's flags read them without the [server]
extra installed)."""

#: Default cap on a request body (`--max-body-bytes`).
MAX_BODY_BYTES = 4 << 20
#: Cap on `n` (choices per prompt).
MAX_N = 16
#: Default cap on the positions one request spans, its prompt plus max_tokens (`--max-prompt-tokens`): 16 prefill
#: chunks (the core forwards a prompt 512 positions at a time), what a CPU prefills in seconds on small models
#: (benches/results/reliability.md, "Hostile input, round two: the server"), not a checkpoint's 32k-128k context.
MAX_PROMPT_TOKENS = 8192
#: Default per-request deadline in seconds (`--request-timeout`): the work of a request still running then is
#: cancelled. Generous: a long completion on a CPU, or lm-eval's scoring of a batch of long prompts, takes minutes.
REQUEST_TIMEOUT = 600.0
#: Seconds a connection has to send its request line and headers (`--header-timeout`).
HEADER_TIMEOUT = 10.0
#: Seconds a request has to send its whole body once its headers are in (`--body-timeout`), then 408 and the
#: connection closed: a 4 MiB body (MAX_BODY_BYTES) needs about 140 KB/s, while a client that stalls mid-body holds
#: its connection (and, at the connection cap, a place) for at most this long, not for the request's deadline.
BODY_TIMEOUT = 30.0
#: The connection cap's default, where the open-files limit allows it (`--limit-concurrency`).
CONNECTIONS = 1000
#: Seconds a streaming response may go without an event before it sends an SSE comment (": keep-alive",
#: `--sse-keepalive`): a long prefill or a wait in the queue stays under the 15-60 s idle timeouts of proxies.
KEEPALIVE = 3.0
#: With stream_options.include_progress, how often a streaming response looks at its prompts' prefill and sends an
#: "mbd_progress" event when it has moved.
PROGRESS_EVERY = 0.5
