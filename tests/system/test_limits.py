"""Hostile numbers, sizes and disks: a diverged update never reaches a checkpoint; one oversized question or passage
cannot take the machine's memory; log appends and folder flushes that fail say so in one line, and what an
interrupted command leaves behind is cleaned by the next one."""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    assert_one_line_error,
    cli,
    copy_run,
    fresh_model,
    hand_samples,
    param_snapshot,
    train_overrides,
)
from safetensors.torch import load_file

import mhgpo.rl.losses as losses_module
from mhgpo.cli.main import error_line
from mhgpo.config import LoraConfig, OptimConfig
from mhgpo.errors import InputError, NotFinite, RunError
from mhgpo.io import append_jsonl, atomic_write_text, fsync_dir
from mhgpo.model.checkpoint import list_checkpoints
from mhgpo.rl.policy import Policy
from mhgpo.runtime.runlog import RunLog, read_metrics

# ------------------------------------------------------------------------------------- non-finite updates


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_is_refused_before_the_optimiser_step(tiny_model_dir, monkeypatch, bad) -> None:
    """A NaN / infinite loss raises NotFinite and leaves every weight and the optimiser state as they were."""
    loaded = fresh_model(tiny_model_dir)
    samples = hand_samples(loaded)
    policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, OptimConfig(lr=1e-3), LoraConfig(r=4), 10)
    policy.update(samples)  # a good step first: the optimiser has state
    before = param_snapshot(policy.model)
    state_before = {
        k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)}
        for k, s in policy.optimizer.state_dict()["state"].items()
    }
    real = policy.loss
    monkeypatch.setattr(policy, "loss", lambda *a, **k: (lambda out: (out[0] * bad, out[1]))(real(*a, **k)))
    with pytest.raises(NotFinite, match=r"the loss/gradient is not finite \(loss (nan|-?inf), gradient norm nan\)"):
        policy.update(samples)
    after = param_snapshot(policy.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    state_after = policy.optimizer.state_dict()["state"]
    assert all(torch.equal(v, state_after[k][n]) for k, s in state_before.items() for n, v in s.items())


def test_a_diverged_step_stops_the_run_and_keeps_the_last_good_checkpoint(
    tiny_model_dir, world, tmp_path, monkeypatch, capsys
) -> None:
    """Step 2's loss is NaN with keep_checkpoints=1: the run stops with one line naming the step and the kept
    checkpoint; step_1 is not rotated away, nothing of step 2 is logged or saved, errors.jsonl says why."""
    out = tmp_path / "nan"
    real = losses_module.mhgpo_policy_loss
    calls = []

    def loss(*a, **k):
        value, stats = real(*a, **k)
        calls.append(1)
        return (value * math.nan if steps_done() >= 1 else value), stats

    steps_done = lambda: len(read_metrics(out)) if out.exists() else 0  # noqa: E731
    monkeypatch.setattr(losses_module, "mhgpo_policy_loss", loss)  # (the loss table's entry names it)
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, out, keep_checkpoints=1, eval_every=0))
    assert_one_line_error(
        rc,
        err,
        r"^mhgpo: error: step 2: the loss/gradient is not finite \(loss nan, gradient "
        r"norm nan\); the update was not applied; the last good checkpoint step_1 is kept",
    )
    assert [p.name for p in list_checkpoints(out)] == ["step_1"]
    weights = load_file(str(out / "checkpoints" / "step_1" / "model.safetensors"))
    assert weights and all(bool(torch.isfinite(t).all()) for t in weights.values())
    assert [r["step"] for r in read_metrics(out)] == [1]
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["step"], e["phase"]) for e in errors] == [(2, "train")]
    assert "not finite" in errors[0]["error"]
    assert not (out / "rollouts" / "step_000002.jsonl").exists()


def test_weights_made_non_finite_by_an_update_stop_the_run_before_they_are_saved(
    tiny_model_dir, world, tmp_path, monkeypatch, capsys
) -> None:
    """A finite loss whose update still leaves an infinite weight (an optimiser overflow) is caught after the
    update, before the step is logged or saved."""
    out = tmp_path / "inf"
    real = Policy.update

    def update(self, samples, *rest):
        stats = real(self, samples, *rest)
        if len(read_metrics(out)) >= 1:
            with torch.no_grad():
                self.params[0].view(-1)[0] = math.inf
        return stats

    monkeypatch.setattr(Policy, "update", update)
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, out, keep_checkpoints=1, eval_every=0))
    assert_one_line_error(
        rc,
        err,
        r"^mhgpo: error: step 2: the trained weights are not finite after the update; the "
        r"last good checkpoint step_1 is kept",
    )
    assert [p.name for p in list_checkpoints(out)] == ["step_1"]
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_the_warm_start_refuses_a_non_finite_loss_before_its_optimiser_step(tiny_model_dir, monkeypatch) -> None:
    import mhgpo.rl.sft as sft

    loaded = fresh_model(tiny_model_dir)
    samples = hand_samples(loaded)
    policy = Policy(
        loaded.model, loaded.tokenizer.pad_token_id, OptimConfig(lr=1e-3), LoraConfig(r=4), 10, keep_reference=False
    )
    before = param_snapshot(policy.model)
    real = sft.sft_loss
    monkeypatch.setattr(sft, "sft_loss", lambda *a: real(*a) * math.nan)
    with pytest.raises(NotFinite, match=r"the loss/gradient is not finite \(loss nan, gradient norm nan\)"):
        sft.sft_update(policy, samples)
    after = param_snapshot(policy.model)
    assert all(torch.equal(before[n], after[n]) for n in before)


# ------------------------------------------------------------------------------------------------ durability


def fill(disk: Path, leave: int) -> None:
    stat = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - leave))


def test_an_append_to_a_full_disk_is_one_error_and_keeps_the_earlier_lines(tmpfs: Path) -> None:
    """metrics.jsonl, errors.jsonl (RunLog) and predictions (append_jsonl) on a full tmpfs: one RunError naming the
    file and the cause, the file exactly as it was (no part of the refused line stays), and later appends work once
    there is space again."""
    log = RunLog(tmpfs / "run", tensorboard=False)
    log.log(1, {"loss": 0.5})
    log.error(1, {"phase": "train", "error": "x"})
    append_jsonl(tmpfs / "predictions.jsonl", [{"id": "q1", "prediction": "a"}])
    before = {p: p.read_bytes() for p in (log.metrics_path, log.errors_path, tmpfs / "predictions.jsonl")}
    fill(tmpfs, 8 * 1024)
    big = "x" * 64 * 1024
    attempts = [
        (log.metrics_path, lambda: log.log(2, {"loss": 0.25, "note": big})),
        (log.errors_path, lambda: log.error(2, {"phase": "train", "error": big})),
        (tmpfs / "predictions.jsonl", lambda: append_jsonl(tmpfs / "predictions.jsonl", [{"id": big}])),
    ]
    for path, attempt in attempts:
        with pytest.raises(RunError) as caught:
            attempt()
        assert str(caught.value).startswith(
            f"{path}: could not append (No space left on device); the lines before are intact"
        )
        assert error_line(caught.value) == str(caught.value) and "\n" not in str(caught.value)
        assert path.read_bytes() == before[path]
    assert "mhgpo train --resume" in str(RunLog(tmpfs / "run", resume_step=1, tensorboard=False)._then(2))
    (tmpfs / "filler").unlink()
    log.log(2, {"loss": 0.25})
    assert [r["step"] for r in read_metrics(tmpfs / "run")] == [1, 2]


def test_a_folder_flush_that_fails_is_a_run_error(tmp_path: Path, monkeypatch) -> None:
    """fsync of a folder: an I/O error (or a full disk) is reported as RunError naming the folder; a file system
    that cannot flush folders (EINVAL) is not an error."""
    real = os.fsync

    def failing(code: int):
        def fsync(fd: int) -> None:  # folders only: the file's own flush succeeds
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(code, os.strerror(code))
            real(fd)

        return fsync

    for code in (errno.EIO, errno.ENOSPC):
        monkeypatch.setattr(os, "fsync", failing(code))
        with pytest.raises(RunError, match=rf"^{tmp_path}: could not flush the folder to disk \({os.strerror(code)}\)"):
            fsync_dir(tmp_path)
        with pytest.raises(RunError, match="could not flush the folder"):
            atomic_write_text(tmp_path / "a.txt", "a")
    monkeypatch.setattr(os, "fsync", failing(errno.EINVAL))
    fsync_dir(tmp_path)
    atomic_write_text(tmp_path / "a.txt", "b")
    assert (tmp_path / "a.txt").read_text() == "b"


def dead_temp(target: Path) -> Path:
    """The temporary folder of `target` made by a process that has since ended (as a killed command leaves it)."""
    code = (
        f"from pathlib import Path; from mhgpo.io import temp_path; p = temp_path(Path({str(target)!r})); "
        f"p.mkdir(); (p / 'part').write_text('half'); print(p)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return Path(done.stdout.strip())


def test_a_killed_export_s_temporary_folder_is_removed_by_the_next_export(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "exported"
    stale = dead_temp(out)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = out.parent / f"{stale.name.rsplit('-', 2)[0]}-{live.pid}-0000"
        running.mkdir()  # a live export's folder: left alone
        rc, _, err = cli(capsys, "export", tiny_model_dir, "--out", out)
        assert rc == 0, err
        assert f"mhgpo: removed {stale}, left by an interrupted export" in err
        assert not stale.exists() and running.is_dir() and (out / "config.json").is_file()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["exported", running.name])
    finally:
        live.kill()
        live.wait()


def test_a_killed_index_build_s_temporary_folder_is_removed_by_the_next_build(tmp_path, capsys) -> None:
    from helpers import CORPUS

    from mhgpo.retrieval.bm25 import BM25Retriever, save_index

    index = tmp_path / "idx"
    stale = dead_temp(index)
    save_index(BM25Retriever.build(CORPUS), index)
    assert f"mhgpo: removed {stale}, left by an interrupted index build" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]
    save_index(BM25Retriever.build(CORPUS), index)  # replacing an index leaves nothing beside it either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]


def test_a_cut_checkpoint_save_is_cleaned_with_a_message_when_the_run_resumes(two_steps, tmp_path, capsys) -> None:
    run = copy_run(two_steps, tmp_path / "run")
    cut = run / "checkpoints" / ".tmp_step_3"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"half")
    half_write = run / ".metrics.jsonl.k2j3.tmp"
    half_write.write_text("{}")
    rc, _, err = cli(capsys, "train", "--resume", run, "steps=3")
    assert rc == 0, err
    assert f"mhgpo: removed {half_write}, left by an interrupted save" in err
    assert f"mhgpo: removed {cut}, left by an interrupted save" in err
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")] == []
    assert not half_write.exists()


def test_a_dense_index_naming_a_hub_encoder_is_loaded_offline_only(tmp_path, monkeypatch) -> None:
    """An index's meta.json names its encoder: a hub id is loaded from local files only (no download, no network)
    unless MHGPO_ALLOW_HUB=1; a missing one is one clear error naming the way out."""
    st = pytest.importorskip("sentence_transformers")
    from mhgpo.retrieval import dense

    calls = []

    def recorder(location, **kwargs):
        calls.append((location, kwargs.get("local_files_only")))
        raise OSError("not found")

    monkeypatch.setattr(st, "SentenceTransformer", recorder)
    dense._cached_encoder.cache_clear()
    monkeypatch.delenv("MHGPO_ALLOW_HUB", raising=False)
    with pytest.raises(
        InputError,
        match=r"dense encoder 'someone/encoder': not in the local hub cache, and encoders "
        r"are loaded from local files only; .* set MHGPO_ALLOW_HUB=1",
    ):
        dense.load_encoder("someone/encoder")
    monkeypatch.setenv("MHGPO_ALLOW_HUB", "1")
    with pytest.raises(InputError, match=r"could not load the dense encoder 'someone/encoder' \(OSError"):
        dense.load_encoder("someone/encoder")
    assert calls == [("someone/encoder", True), ("someone/encoder", False)]
    dense._cached_encoder.cache_clear()


def test_a_crafted_dense_meta_json_cannot_fetch_its_encoder(tmp_path, monkeypatch) -> None:
    """The real library, no network: an index whose meta.json names an encoder absent here fails at once."""
    pytest.importorskip("sentence_transformers")
    from mhgpo.retrieval import dense
    from mhgpo.retrieval.bm25 import corpus_fingerprint

    monkeypatch.delenv("MHGPO_ALLOW_HUB", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    index = tmp_path / "idx"
    index.mkdir()
    meta = {
        "format": 1,
        "kind": "dense",
        "model": "mhgpo-test-nobody/never-published",
        "index_type": "flat",
        "dim": 384,
        "normalized": True,
        "doc_template": "{title}: {text}",
        **corpus_fingerprint([]),
    }
    (index / "meta.json").write_text(json.dumps(meta))
    (index / "passages.jsonl").write_text("")
    dense._cached_encoder.cache_clear()
    start = time.perf_counter()
    with pytest.raises(InputError, match="not in the local hub cache"):
        dense.DenseRetriever.load(index)
    assert time.perf_counter() - start < 10


# ------------------------------------------------------------------------------------------------ input size

HUGE = 100_000  # characters: one oversized record


def test_a_passage_without_spaces_is_cut_in_the_prompt() -> None:
    """snippet_words cannot bound a passage with no whitespace (one "word"): snippet_chars does, title too."""
    from mhgpo.data.records import Passage
    from mhgpo.team.search_system import format_documents

    huge = Passage("p0", "T" * HUGE, "x" * HUGE)
    normal = Passage("p1", "Paris", "Paris is the capital of France.")
    text = format_documents([huge, normal], "Document{index} ({title}): {snippet}", snippet_words=60, snippet_chars=600)
    assert text == (
        f"Document0 ({'T' * 600} ...): {'x' * 600} ...\n\nDocument1 (Paris): Paris is the capital of France."
    )
    words = Passage("p2", "W", " ".join(["abcdefghij"] * 100))  # 60 words of 11 chars: cut at 600 characters
    assert format_documents([words], "{snippet}", 60, 600) == ("abcdefghij " * 60)[:600] + " ..."


def write_data(folder: Path, world: Path, huge_question: str) -> Path:
    """The world's first dev question and a 100 KB one (id `huge`), in HotpotQA's layout."""
    rows = [json.loads(line) for line in (world / "dev.jsonl").read_text().splitlines()][:1]
    rows.append({**rows[0], "_id": "huge", "id": "huge", "question": huge_question})
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_one_100_kb_record_fails_or_finishes_cleanly_and_memory_stays_bounded(
    tiny_model_dir,
    world,
    tmp_path,
    cache_dir,  # noqa: F811
) -> None:
    """`mhgpo ask` in a real process with one oversized record, each within 300 MB of the peak resident memory of a
    short question: a 100 KB question (words, or no spaces) fails in one line naming max_prompt_tokens (refused
    before any forward pass); a 100 KB passage without spaces is retrieved, cut in the prompt, and the ask
    finishes."""
    code = (
        "import resource, sys; from mhgpo.cli.main import main; rc = main(sys.argv[1:]); "
        "print('peak_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)"
    )

    def ask(question: str, corpus: Path, *extra: str) -> tuple[int, str, str, float]:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                "ask",
                question,
                "--model",
                str(tiny_model_dir),
                "--corpus",
                str(corpus),
                "search.answerer.max_new_tokens=4",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO), "MHGPO_CACHE": str(cache_dir)},
        )
        peak = [line for line in done.stderr.splitlines() if line.startswith("peak_kb ")]
        err = done.stderr.replace(peak[-1], "") if peak else done.stderr
        return done.returncode, done.stdout, err, int(peak[-1].split()[1]) / 1024 if peak else math.nan

    rc, _, err, short_mb = ask("Who wrote the novel Dune?", world / "corpus.jsonl")
    assert rc == 0, err
    peaks = {}
    for shape, question in (("words", "Who wrote it? " * (HUGE // 14)), ("no spaces", "W" * HUGE)):
        rc, _, err, peaks[f"question ({shape})"] = ask(question, world / "corpus.jsonl")
        assert_one_line_error(
            rc,
            err,
            r"build_prompt: gave a prompt of \d+ tokens, more than max_prompt_tokens=4096 "
            r"\(a very long question or passage\?\); the question is left out \(question "
            r"ask, agent rewriter\)",
        )
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        json.dumps({"id": "big", "title": "Dune", "text": "x" * HUGE})
        + "\n"
        + json.dumps({"id": "small", "title": "Herbert", "text": "Frank Herbert wrote Dune."})
        + "\n"
    )
    rc, out, err, peaks["passage (no spaces)"] = ask("Who wrote the novel Dune?", corpus, "search.top_k=2")
    assert rc == 0, err
    assert "Document0: Dune" in out or "Document1: Dune" in out  # the big passage was retrieved and shown
    print(
        f"\npeak RSS of ask: short question {short_mb:.0f} MB; "  # the measurement, shown with -s
        + "; ".join(f"100 KB {k} {v:.0f} MB" for k, v in peaks.items())
    )
    assert all(v < short_mb + 300 for v in peaks.values()), peaks


def test_training_leaves_out_a_100_kb_question_counted_as_a_failure(
    tiny_model_dir,
    world,
    tmp_path,
    capsys,  # noqa: F811
) -> None:
    """Training on data with a 100 KB question: each time it is drawn it fails (named in errors.jsonl, one warning,
    counted in max_failures) and the run finishes; `max_prompt_tokens` is a key of train, eval and sft configs."""
    data = write_data(tmp_path, world, "Who wrote it? " * (HUGE // 14))
    out = tmp_path / "run"
    rc, _, err = cli(
        capsys, "train", *train_overrides(tiny_model_dir, world, out, steps=2, eval_every=0, data=f"hotpotqa:{data}")
    )
    assert rc == 0, err
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["step"], e["question_id"], e["method"], e["agent"]) for e in errors] == [
        (1, "huge", "build_prompt", "rewriter"),
        (2, "huge", "build_prompt", "rewriter"),
    ]
    assert all("more than max_prompt_tokens=4096" in e["error"] for e in errors)
    assert "question huge, agent rewriter" in err and "2 failed of max_failures=10" in err
    assert [p.name for p in list_checkpoints(out)] == ["step_1", "step_2"]
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, tmp_path / "bad", max_prompt_tokens=0))
    assert_one_line_error(rc, err, r"max_prompt_tokens: must be at least 1, got 0")


def test_eval_stops_at_a_100_kb_question_naming_it_and_keeps_the_finished_ones(
    tiny_model_dir,
    world,
    tmp_path,
    capsys,  # noqa: F811
) -> None:
    """An evaluation scores every question or says which it cannot: one line naming the question and the limit;
    the questions finished before it stay in predictions.jsonl."""
    data = write_data(tmp_path, world, "W" * HUGE)
    out = tmp_path / "eval"
    rc, _, err = cli(
        capsys,
        "eval",
        "--data",
        f"hotpotqa:{data}",
        "--corpus",
        world / "corpus.jsonl",
        "--model",
        tiny_model_dir,
        "--batch-size",
        1,
        "--output-dir",
        out,
        "search.rewriter.max_new_tokens=4",
        "search.reranker.max_new_tokens=4",
        "search.answerer.max_new_tokens=4",
    )
    assert_one_line_error(rc, err, r"more than max_prompt_tokens=4096 .*\(question huge, agent rewriter\)")
    first = json.loads(data.read_text().splitlines()[0])["_id"]
    assert [json.loads(line)["id"] for line in (out / "predictions.jsonl").read_text().splitlines()] == [first]


def test_warm_start_leaves_out_demonstrations_with_too_long_prompts(tiny_lm, world, capsys) -> None:
    """The supervised warm start: a demonstration whose prompt is over max_prompt_tokens is left out, its chain
    stops there (counted in skipped/<agent>), and one warning names how many and the first question."""
    from mhgpo.config import RetrievalConfig, SearchConfig
    from mhgpo.data.formats import load_hotpotqa
    from mhgpo.model.pretrained import encode_chat
    from mhgpo.rl.sft import collect_demonstrations, target_encoder
    from mhgpo.team.build import build_workflow

    examples = load_hotpotqa(world / "train.jsonl")[:4]
    workflow = build_workflow("mas", "hotpotqa:x", RetrievalConfig(corpus=str(world / "corpus.jsonl")), SearchConfig())
    encode = lambda m: encode_chat(tiny_lm.tokenizer, m)  # noqa: E731
    to_ids = target_encoder(tiny_lm.tokenizer)
    demos, skipped = collect_demonstrations(examples, workflow, encode, to_ids)
    assert "warning" not in capsys.readouterr().err
    rewriter = max(len(d.prompt_ids) for d in demos if d.agent == "rewriter")
    longer = min(len(d.prompt_ids) for d in demos if d.agent != "rewriter")
    assert rewriter < longer  # the Rewriter's prompt (the question alone) is the shortest
    cut, cut_skipped = collect_demonstrations(examples, workflow, encode, to_ids, max_prompt_tokens=rewriter)
    assert [d.agent for d in cut] == ["rewriter"] * len(examples)
    assert cut_skipped == {"skipped/reranker": len(examples)}
    err = capsys.readouterr().err
    assert err.startswith(
        f"mhgpo: warning: {len(examples)} demonstration(s) left out: their prompts are longer "
        f"than max_prompt_tokens={rewriter} (the first: question {examples[0].id}, agent reranker"
    )


def test_eval_retrieval_refuses_a_rewriter_prompt_over_the_limit_before_generating() -> None:
    """`mhgpo eval-retrieval --query rewriter` builds the Rewriter's prompts itself: one over max_prompt_tokens is
    an InputError naming the question, and nothing is generated."""
    from mhgpo.config import SearchConfig
    from mhgpo.data.records import Example
    from mhgpo.team.retrieval_eval import rewriter_queries

    class Refusing:
        def generate(self, prompts, params):  # noqa: ANN001, ANN201
            raise AssertionError("generated")

    examples = [Example("short", "Who?", ("a",)), Example("huge", "W" * HUGE, ("a",))]
    encode = lambda messages: list(messages[-1]["content"].encode())  # noqa: E731 - a byte per token
    with pytest.raises(
        InputError,
        match=r"^question huge: the Rewriter's prompt is \d+ tokens, more than "
        r"max_prompt_tokens=4096 \(a very long question\?\)$",
    ):
        rewriter_queries(examples, Refusing(), encode, SearchConfig(), progress=False)
