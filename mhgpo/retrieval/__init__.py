"""Retrievers over a corpus: BM25 and dense indexes built once and reloaded; the retrieval service and its client."""
