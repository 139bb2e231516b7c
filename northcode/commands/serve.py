"""`northcode serve`: the OpenAI-compatible endpoint (starlette + uvicorn) on a local port.

uvicorn starts first and the model loads in a background thread, so GET /health answers 503
with the loading phase until the engine is ready. Loopback only unless --host says otherwise.
When the model is ready the URL, the decode backend (and why it was chosen) and an OpenCode
provider snippet are printed, with a warning for each agent whose own prompt does not fit the context. `--backend megakernel` where the megakernel cannot run is refused at
once (exit 2, the reason in one line), before uvicorn starts or a weight is read.

If the engine fails for good while serving (a step that never returns: a lost GPU), /health answers
503 with the error, new requests get a 503, and the command prints the error and exits 1 once
uvicorn has stopped, through os._exit: the engine's step thread may be stuck in a call on the lost
device, and an ordinary interpreter exit could wait on it forever. A supervisor can then restart it.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import threading

HELP = "serve the model on a local OpenAI-compatible endpoint"
FORCE_EXIT_AFTER_S = 5.0  # after a fatal engine error: how long uvicorn may wait for open connections
CLIENT_PROMPT_TOKENS = {  # a client's own system prompt and tools: its first request before the user's words
    "OpenCode": 10_000,  # 9,641 and 10,969 tokens for "hi" in reports (anomalyco/opencode#17304, #9611)
    "Codex CLI": 19_000,  # its first request to northcode serve (docs/server.md)
    "Claude Code": 40_000,  # with the tiny checkpoint's tokenizer (docs/server.md)
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the demo checkpoint, random weights)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    parser.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every API request")
    parser.add_argument("--served-model-name", default="north-mini-code", help="model id in /v1/models and responses")
    parser.add_argument("--allowed-origins", metavar="ORIGINS", default="",
                        help="comma-separated browser origins allowed by CORS, or '*' (default: none, no CORS headers)")
    parser.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default: 8)")
    parser.add_argument("--max-queue", type=int, default=32, help="requests waiting beyond the batch before 503 (default: 32)")
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's, capped by the KV pool)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.90, help="of free GPU memory for the KV cache (default: 0.90)")
    parser.add_argument("--backend", choices=("auto", "torch", "megakernel"), default="auto",
                        help="decode backend (default: auto, which picks one and says why when the model is ready)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--num-pages", type=int, help="fixed KV pool size in 64-token pages (default: from memory)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch's CPU threads (default: OMP_NUM_THREADS, else half the cores, at most 4)")
    parser.add_argument("--system-prompt", help="system prompt used when a chat has none ('' for none)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def opencode_snippet(base_url: str, model_name: str, context: int, api_key: str | None) -> str:
    options = {"baseURL": f"{base_url}/v1", **({"apiKey": api_key} if api_key else {})}
    provider = {"northcode": {
        "npm": "@ai-sdk/openai-compatible", "name": "northcode", "options": options,
        "models": {model_name: {"name": model_name, "limit": {"context": context, "output": min(32000, context // 4)},
                                "tool_call": True, "reasoning": True}},
    }}
    return json.dumps({"$schema": "https://opencode.ai/config.json", "provider": provider}, indent=2)


def prompt_fit_warning(client: str, context: int) -> str:
    """A warning line when `client`'s own prompt does not fit a `context` of that many tokens, else ''."""
    needed = CLIENT_PROMPT_TOKENS[client]
    if context >= needed:
        return ""
    return (f"warning: {client}'s own system prompt and tools take about {needed:,} tokens and this server's "
            f"context is {context:,}: its first request will not fit. Serve a model with a longer context "
            f"(--model DIR; the context is the model's, capped by the KV pool: --num-pages, --gpu-memory-fraction).")


def client_setup(base_url: str, model_name: str, context: int, api_key: str | None) -> str:
    """The ready banner's part for other agents: OpenCode's snippet, then Claude Code's and Codex CLI's setup,
    each after a warning when its prompt does not fit the context."""
    opencode = ["OpenCode: put this in opencode.json (or ~/.config/opencode/opencode.json):",
                opencode_snippet(base_url, model_name, context, api_key)]
    warnings = [prompt_fit_warning(client, context) for client in ("OpenCode", "Claude Code", "Codex CLI")]
    return "\n".join([line for line in warnings[:1] if line] + opencode + [line for line in warnings[1:] if line]
                     + [agent_cli_setup(base_url, model_name, context, api_key)])


def agent_cli_setup(base_url: str, model_name: str, context: int, api_key: str | None) -> str:
    """How Claude Code (the Messages API) and Codex CLI (the Responses API) reach this server: README's setup."""
    key = api_key or "unused"
    return (f"Claude Code: ANTHROPIC_BASE_URL={base_url} ANTHROPIC_AUTH_TOKEN={key} claude --model {model_name}\n"
            f"Codex CLI: in ~/.codex/config.toml\n"
            f'  model = "{model_name}"\n  model_provider = "northcode"\n  model_context_window = {context}\n'
            f'  [model_providers.northcode]\n  name = "northcode"\n  base_url = "{base_url}/v1"\n'
            f'  env_key = "NORTHCODE_API_KEY"\n  wire_api = "responses"\n'
            f"then NORTHCODE_API_KEY={key} codex")


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port for uvicorn; ValueError naming the option when that fails."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ValueError(f"--host {host}: not an address this machine can bind ({err.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use (another northcode serve?); "
                             "stop it or choose another port") from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror})") from None
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from northcode.engine.settings import EngineSettings
    from northcode.paths import model_display_name, resolve_model
    from northcode.runtime import check_backend_setting
    from northcode.server.app import create_app
    from northcode.server.state import DEFAULT_SYSTEM_PROMPT, ServerOptions, ServerState

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: must be in [0, 65535]")
    settings = EngineSettings(max_batch=args.max_batch, gpu_memory_fraction=args.gpu_memory_fraction, backend=args.backend,
                              device=args.device, max_model_len=args.max_model_len, num_pages=args.num_pages,
                              num_threads=args.threads)
    if args.max_queue < 0:
        raise ValueError(f"--max-queue {args.max_queue}: must be >= 0")
    model_dir = resolve_model(args.model)
    check_backend_setting(model_dir, settings)  # a megakernel that cannot run here: exit 2 now, not after loading
    system_prompt = DEFAULT_SYSTEM_PROMPT if args.system_prompt is None else (args.system_prompt or None)
    origins = tuple(origin.strip() for origin in args.allowed_origins.split(",") if origin.strip())
    options = ServerOptions(model_name=args.served_model_name, api_key=args.api_key, max_batch=args.max_batch,
                            max_queue=args.max_queue, default_system_prompt=system_prompt, allowed_origins=origins)
    listener = bind_listener(args.host, args.port)  # before loading: a taken port is a clear error at once
    state = ServerState(options)
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level=args.log_level))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach this port can use the model", file=sys.stderr)
    print(f"northcode serve: loading {model_display_name(model_dir)} from {model_dir}", file=sys.stderr)
    state.load_in_background(model_dir, settings)
    outcome: dict = {}
    threading.Thread(target=_announce_when_ready, args=(state, server, args, outcome), daemon=True).start()
    try:
        server.run(sockets=[listener])
    finally:
        if state.engine is not None:
            state.engine.shutdown()  # after a fatal error it does not wait for the step thread
    if state.engine_error is not None:
        print(f"northcode serve: exiting (status 1) because the engine failed: {state.engine_error}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # not sys.exit: a thread stuck on the lost device would keep the interpreter from exiting
    return 1 if outcome.get("failed") else 0


def _announce_when_ready(state, server, args: argparse.Namespace, outcome: dict) -> None:
    import time

    from northcode.paths import model_display_name

    last_phase = None
    while not state.ready and state.load_error is None and not state.engine_failed.is_set():
        if state.phase != last_phase:
            print(f"  {state.phase}", file=sys.stderr)
            last_phase = state.phase
        time.sleep(0.1)
    if state.load_error is not None:
        print(f"northcode serve: error: the model failed to load: {state.load_error}", file=sys.stderr)
        outcome["failed"] = True
        server.should_exit = True
        return
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    base_url = f"http://{host}:{port}"
    print(f"\nnorthcode serve: ready at {base_url}/v1 (model id {state.options.model_name!r}, "
          f"context {state.engine.max_model_len} tokens)", file=sys.stderr)
    print(f"  serving {model_display_name(state.model_dir)} from {state.model_dir}", file=sys.stderr)
    stats = state.engine.stats()
    print(f"  backend: {stats['backend']} ({stats['backend_reason']})", file=sys.stderr)
    print(client_setup(base_url, state.options.model_name, state.engine.max_model_len, args.api_key), file=sys.stderr)
    _stop_when_the_engine_fails(state, server)


def _stop_when_the_engine_fails(state, server) -> None:
    """Wait for the engine's fatal error (ServerState's listener sets engine_failed), then stop uvicorn;
    run() exits 1 once it has stopped. Connections still open after FORCE_EXIT_AFTER_S are dropped."""
    import time

    state.engine_failed.wait()
    print(f"\nnorthcode serve: error: the engine failed and cannot serve any more: {state.engine_error}",
          file=sys.stderr, flush=True)
    server.should_exit = True
    time.sleep(FORCE_EXIT_AFTER_S)
    server.force_exit = True
