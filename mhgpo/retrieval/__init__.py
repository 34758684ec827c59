"""Retrieval over a passage corpus: BM25 (`bm25`), dense (`dense`), a retrieval service (`http`, `service`).

bm25s selects its top k with JAX wherever JAX is installed, and JAX started on a GPU takes 75% of the GPU's memory
for itself at once: a model trained in the same process then runs out of memory (measured on an H200: 105 of its
140 GiB gone, the next 1.5B-parameter LoRA run out of memory at 3.6 GiB). JAX is kept to the CPU, where BM25's
NumPy scores are anyway, unless `JAX_PLATFORMS` is set already.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
