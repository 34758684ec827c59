"""What the `mhgpo` sub-commands share: the help texts and flags common to several commands, and the `--flag` →
`key=value` translation."""

from __future__ import annotations

import argparse

from mhgpo.config.choices import RETRIEVERS

DATA_HELP = (
    "synthetic (default), synthetic:train, hotpotqa:PATH, 2wiki:PATH, musique:PATH, jsonl:PATH, "
    "or hotpotqa / 2wiki / musique (from the Hugging Face hub)"
)
CORPUS_HELP = "'context' (the data's own paragraphs), a JSONL corpus (id, title, text) or a DPR .tsv file"
RETRIEVER_HELP = (
    "bm25 (default), dense (sentence-transformers + FAISS; encoder: retrieval.model=M), or the URL of "
    "a retrieval service: http://HOST:PORT/retrieve (mhgpo serve-retriever, Search-R1's server)"
)
INDEX_HELP = "a built index folder to reuse (mhgpo index build)"
MODEL_HELP = (
    "smollm2-135m (default), a Hugging Face id, a local folder, a .gguf file, or a trained run: a run "
    "directory (its latest checkpoint) or RUN/checkpoints/step_N"
)
SYSTEM_HELP = (
    "mas (the default team), llm (the model alone), or a Workflow class of your own: PATH.py:Class or "
    "module.path:Class (its config section: team.KEY=value)"
)

SCALE_HELP = (
    "with --config ROWS.yaml:ROW: run the row at a scale of its table (demo: the demo's model, data, steps, batch, "
    "tokens and LoRA)"
)
TRUST_HELP = (
    "with --resume: import the workflow class (system: PATH.py:Class or module:Class) that the folder's "
    "saved config names; without it (or the same --system again) such a folder is refused"
)


def flag_overrides(args: argparse.Namespace, mapping: dict[str, str]) -> list[str]:
    """`--flag value` → `key=value` for every flag given on the command line."""
    out = []
    for attr, key in mapping.items():
        value = getattr(args, attr, None)
        if value is not None:
            out.append(f"{key}={value}")
    return out


ROW_CONFIG_HELP = "a YAML config file, or a row of a table of rows: experiments/rows.yaml:ROW"


def add_common_flags(p: argparse.ArgumentParser, config_help: str = "a YAML config file") -> None:
    """The flags of every command that runs a team: config file, model, corpus, retriever, index, system and the
    trailing `key=value` overrides."""
    p.add_argument("--config", help=config_help)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--corpus", help=CORPUS_HELP)
    p.add_argument("--retriever", metavar="|".join(RETRIEVERS) + "|URL", help=RETRIEVER_HELP)
    p.add_argument("--index", help=INDEX_HELP)
    p.add_argument("--system", metavar="SYSTEM", help=SYSTEM_HELP)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
