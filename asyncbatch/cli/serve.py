"""``asyncbatch serve [MODEL]``: the OpenAI-compatible HTTP server (needs the ``serve`` extra).

    pip install -e ".[serve]"
    asyncbatch serve --device cpu --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 16}'

Binds 127.0.0.1 unless ``--host`` says otherwise. ``--api-key`` (or the
``ASYNCBATCH_API_KEY`` environment variable) requires ``Authorization: Bearer
<key>`` on ``/v1``. SIGTERM (or SIGINT) drains (see ``serve.server``; with ``--replicas N``,
``cluster.lifecycle``) and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os

from asyncbatch.cli.args import add_engine_args, engine_kwargs
from asyncbatch.config import SimConfig

_SIM = SimConfig()


def add_serve_command(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (pip install -e '.[serve]')",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="HF directory, .gguf file, or alias (default: smollm2-135m); same as --model")
    add_engine_args(p)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: by memory)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: token-id prompts in, token ids out (return_token_ids)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (cpu backend)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run each engine's core in its own process (default); --no-engine-process runs it in the "
                        "server's (with --replicas, the replica's) process: half the processes to start, for "
                        "debugging and tests")
    p.add_argument("--sim-step-ms", type=float, default=_SIM.step_fixed_ms, help="sim: fixed cost per step")
    p.add_argument("--sim-per-token-us", type=float, default=_SIM.per_token_us)
    p.add_argument("--sim-per-context-ns", type=float, default=_SIM.per_context_token_ns)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) requests may use for the model; the first is reported (default: MODEL)")
    p.add_argument("--api-key", default=os.environ.get("ASYNCBATCH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $ASYNCBATCH_API_KEY)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests waiting to be scheduled beyond which new ones get 503 + Retry-After")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="uvicorn's access log line per HTTP request")
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let chat requests bring their own chat_template (vLLM's flag; off: a 400)")
    p.add_argument("--structured-outputs-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="build the grammar compiler at start, so the first structured request does not wait ~1 s "
                        "for it (default: on)")
    p.add_argument("--replicas", type=int, default=1,
                   help="engine replicas; > 1 runs them on Ray Serve (pip install -e '.[cluster]'), see docs/scaling.md")
    p.add_argument("--router", default="cache-aware", choices=["cache-aware", "pow2", "ray-prefix"],
                   help="with --replicas > 1: how requests are routed (default: longest cached prefix vs load)")
    p.add_argument("--address", default=None,
                   help="with --replicas > 1: the Ray cluster to join ('auto' after `ray start`; default: start a "
                        "local one)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1 or args.address is not None:
        return _serve_cluster(args)
    try:
        from asyncbatch.serve.server import bind_socket, run_server
        from asyncbatch.serve.settings import ServeSettings
    except ImportError as exc:
        raise SystemExit(f"asyncbatch serve needs the serve extra ({exc.name} is missing): "
                         "pip install -e '.[serve]'") from exc
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        raise ValueError(f"model given twice: {args.model_arg!r} and --model {args.model!r}")
    model, settings, kwargs = _model_settings_kwargs(args, ServeSettings)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = bind_socket(args.host, args.port)  # a busy port fails before the model loads
    try:
        if kwargs["engine_process"]:
            # The core's fork server imports the engine on the other core while this process does
            # (engine.fork_server: ready about 4 s sooner on 2 cores).
            from asyncbatch.engine.fork_server import start_early

            start_early()
        # The engine (torch, transformers: ~6 s of CPU on 2 cores) is imported after the port check, so a
        # busy port is reported at once.
        from asyncbatch.serve.async_llm import AsyncLLM

        engine = AsyncLLM(model, **kwargs)
    except BaseException:
        sock.close()
        raise
    try:
        return run_server(engine, settings, sock, log_level=args.log_level, access_log=args.access_log)
    finally:
        engine.close()


def _model_settings_kwargs(args: argparse.Namespace, settings_cls) -> tuple[str | None, object, dict]:
    """The model, the server settings and the engine keywords the options give (one engine or a replica)."""
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        raise ValueError(f"model given twice: {args.model_arg!r} and --model {args.model!r}")
    model = args.model_arg or args.model
    names = tuple(args.served_model_name or [model or "smollm2-135m"])
    settings = settings_cls(names, api_key=args.api_key, max_waiting=args.max_waiting,
                            max_body_bytes=args.max_request_bytes, shutdown_timeout_s=args.shutdown_timeout,
                            log_requests=not args.disable_log_requests,
                            trust_request_chat_template=args.trust_request_chat_template)
    kwargs = engine_kwargs(args, overlap=not args.no_overlap)
    kwargs.update(num_kv_blocks=args.num_kv_blocks,
                  skip_tokenizer_init=args.skip_tokenizer_init, num_threads=args.num_threads,
                  engine_process=args.engine_process, structured_outputs_warmup=args.structured_outputs_warmup)
    if args.device == "sim":
        kwargs["sim"] = SimConfig(step_fixed_ms=args.sim_step_ms, per_token_us=args.sim_per_token_us,
                                  per_context_token_ns=args.sim_per_context_ns)
    return model, settings, kwargs


def _serve_cluster(args: argparse.Namespace) -> int:
    """``--replicas N``: N engines as Ray Serve replicas behind one OpenAI ingress (``asyncbatch.cluster``)."""
    try:
        from asyncbatch.cluster import (  # layering: the CLI starts the cluster only when asked (ray is optional)
            launch,
            lifecycle,
        )
        from asyncbatch.serve.settings import ServeSettings
    except ImportError as exc:
        raise SystemExit(f"asyncbatch serve --replicas needs the cluster extra ({exc.name} is missing): "
                         "pip install -e '.[serve,cluster]'") from exc
    model, settings, kwargs = _model_settings_kwargs(args, ServeSettings)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = launch.ClusterSpec(num_replicas=args.replicas, router=args.router,
                              replica_num_gpus=1.0 if args.device == "cuda" else 0.0)
    return lifecycle.serve_until_stopped(spec, model, {k: v for k, v in kwargs.items() if v is not None}, settings,
                                         args.host, args.port, address=args.address)
