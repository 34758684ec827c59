"""Retrievers over a corpus: BM25 and dense indexes built once and reloaded; the retrieval service and its client;
the retriever a config asks for (`build.py`)."""

import os

# bm25s selects its top k with JAX wherever JAX is installed, and JAX started on a GPU takes 75% of its memory at
# once (on an H200: 105 of 140 GiB, and the model trained in the same process then ran out of memory); BM25's scores
# are NumPy arrays on the CPU anyway. Unless the user chose JAX's platforms, JAX stays on the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
