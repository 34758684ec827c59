"""Evaluation on the tiny model: batching changes the speed, never the answers."""

from __future__ import annotations

import pytest

from mhgpo.config import EvalConfig, load_config
from mhgpo.data.forms import form_metrics, is_form_metric

SEARCH = ["search.rewriter.max_new_tokens=12", "search.reranker.max_new_tokens=6", "search.answerer.max_new_tokens=8"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_batched_evaluation_equals_one_question_at_a_time(tiny_model_dir, world, precision) -> None:
    from mhgpo.model.generation import HFGenerator
    from mhgpo.model.precision import weight_dtype
    from mhgpo.model.pretrained import encode_chat
    from mhgpo.model.trained import load_model
    from mhgpo.rl.evaluation import evaluate_examples
    from mhgpo.team.build import build_workflow, load_examples

    data = f"hotpotqa:{world / 'dev.jsonl'}"
    cfg = load_config(EvalConfig, None, [f"retrieval.corpus={world / 'corpus.jsonl'}", *SEARCH])
    workflow = build_workflow("mas", data, cfg.retrieval, cfg.search)
    examples = load_examples(data)
    lm = load_model(str(tiny_model_dir), device="cpu", dtype=weight_dtype(precision, trainable=False))

    def run(batch_size: int, gen_batch_size: int):
        generator = HFGenerator(lm.model, lm.tokenizer, batch_size=gen_batch_size, precision=precision)
        return evaluate_examples(
            examples, workflow, generator, lambda m: encode_chat(lm.tokenizer, m), batch_size, progress=False
        )

    alone = run(1, 1)
    for batch_size, gen_batch_size in ((len(examples), len(examples)), (4, 3)):
        batched = run(batch_size, gen_batch_size)
        assert [p["trace"] for p in batched.predictions] == [p["trace"] for p in alone.predictions]
        assert [p["prediction"] for p in batched.predictions] == [p["prediction"] for p in alone.predictions]
        assert {k: v for k, v in batched.metrics.items() if k != "seconds"} == {
            k: v for k, v in alone.metrics.items() if k != "seconds"
        }
    # each record says its question's type; the metrics give F1 by question form from the records alone
    assert [p["type"] for p in alone.predictions] == [e.type for e in examples] and all(e.type for e in examples)
    forms = form_metrics(alone.predictions)
    assert {k: v for k, v in alone.metrics.items() if is_form_metric(k)} == forms
    assert forms["form/yes_no/n"] + forms["form/choice/n"] + forms["form/other/n"] == len(examples)
    outputs = {s["output"] for p in alone.predictions for s in p["trace"]["steps"] if "tool" not in s}
    assert len(outputs) >= 3  # the questions lead to different outputs: the comparison sees something
