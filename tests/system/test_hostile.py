"""Hostile folders and command lines: links planted where mhgpo writes, folders that look like its own, run and
evaluation folders that name code, and resumes that would quietly become another run. Each case must end with one
`mhgpo: error:` line (or do what was asked), touch no file outside the folder being written, and run no code.

Commands run in-process through `mhgpo.cli.main.main` (what `python -m mhgpo` runs); links are real symlinks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import assert_one_line_error, cli, copy_run, snapshot

from mhgpo.config import EvalConfig, SFTConfig, TrainConfig, dump_config, load_config
from mhgpo.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from mhgpo.retrieval.bm25 import MARKER_FILE, BM25Retriever
from mhgpo.retrieval.build import open_index
from mhgpo.runtime.runlog import read_metrics
from mhgpo.team import loader

EVIL = """
from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("the file ran")
from mhgpo.team.search_system import SearchSystem as Evil
"""


def corpus(folder: Path) -> Path:
    path = folder / "corpus.jsonl"
    path.write_text(
        '{"id": "a", "title": "Paris", "text": "capital of France"}\n'
        '{"id": "b", "title": "Rome", "text": "capital of Italy"}\n',
        encoding="utf-8",
    )
    return path


def outside(tmp_path: Path) -> Path:
    """A file the commands must never touch (the stand-in for a user's file elsewhere)."""
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir(exist_ok=True)
    target.write_text("precious\n", encoding="utf-8")
    return target


# ------------------------------------------------------------------------------------------------ index folders


def test_index_build_refuses_a_users_folder_that_holds_a_meta_json(tmp_path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "meta.json").write_text('{"format": 1, "count": 0, "sha256": "x"}\n')
    (out / "thesis.tex").write_text("years of work\n")
    before = snapshot(tmp_path)
    rc, _, err = cli(capsys, "index", "build", "--corpus", corpus(tmp_path), "--out", out)
    assert_one_line_error(
        rc,
        err,
        rf"{out}: holds files and is not an index mhgpo wrote \(no mhgpo-index\.json\); "
        r"refusing .* pass --overwrite",
    )
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k != "corpus.jsonl"} == before


def test_index_build_overwrite_writes_only_the_index_files(tmp_path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work\n")
    (out / "sub").mkdir()
    (out / "sub" / "data.txt").write_text("more\n")
    rc, _, err = cli(capsys, "index", "build", "--corpus", corpus(tmp_path), "--out", out, "--overwrite")
    assert rc == 0, err
    assert (out / "thesis.tex").read_text() == "years of work\n" and (out / "sub" / "data.txt").read_text() == "more\n"
    assert [p.id for p in open_index(out).search("capital of Italy", 1)] == ["b"]
    marker = json.loads((out / MARKER_FILE).read_text())
    assert "thesis.tex" not in marker["files"] and "passages.jsonl" in marker["files"]
    # Rebuilt without --overwrite: the marker makes it ours; the user's files beside it are still left alone.
    rc, _, err = cli(capsys, "index", "build", "--corpus", corpus(tmp_path), "--out", out)
    assert rc == 0, err
    assert (out / "thesis.tex").read_text() == "years of work\n" and (out / "sub" / "data.txt").is_file()


def test_rebuilding_an_index_replaces_planted_links_and_never_follows_them(tmp_path, capsys) -> None:
    target = outside(tmp_path)
    out = tmp_path / "index"
    rc, _, err = cli(capsys, "index", "build", "--corpus", corpus(tmp_path), "--out", out)
    assert rc == 0, err
    (out / "passages.jsonl").unlink()
    (out / "passages.jsonl").symlink_to(target)
    (out / "notes.txt").symlink_to(target)  # not an index file: stays, and is not followed
    rc, _, err = cli(capsys, "index", "build", "--corpus", corpus(tmp_path), "--out", out)
    assert rc == 0, err
    assert target.read_text() == "precious\n"
    assert not (out / "passages.jsonl").is_symlink() and (out / "notes.txt").is_symlink()
    assert [p.id for p in open_index(out).search("Paris", 1)] == ["a"]


def test_a_forged_marker_cannot_name_files_outside_the_folder(tmp_path, capsys) -> None:
    target = outside(tmp_path)
    out = tmp_path / "index"
    out.mkdir()
    (out / "keep.txt").write_text("keep\n")
    (out / MARKER_FILE).write_text(
        json.dumps(
            {"mhgpo_index": 1, "kind": "bm25", "files": [f"../elsewhere/{target.name}", str(target), "keep.txt"]}
        )
    )
    rc, _, err = cli(capsys, "index", "build", "--corpus", corpus(tmp_path), "--out", out)
    assert rc == 0, err
    assert target.read_text() == "precious\n"  # a marker claims only the names of mhgpo's index files
    assert (out / "keep.txt").read_text() == "keep\n"


def test_index_out_as_a_link_is_refused(tmp_path, capsys) -> None:
    elsewhere = outside(tmp_path).parent
    link = tmp_path / "link"
    link.symlink_to(elsewhere, target_is_directory=True)
    before = snapshot(elsewhere)
    rc, _, err = cli(capsys, "index", "build", "--corpus", corpus(tmp_path), "--out", link)
    assert_one_line_error(rc, err, rf"{link}: is a link; pass the folder it points to")
    assert snapshot(elsewhere) == before


def test_an_index_saved_before_markers_is_still_loaded_and_replaced(tmp_path, capsys) -> None:
    from mhgpo.data.formats import load_corpus_jsonl

    out = tmp_path / "old"
    BM25Retriever.build(load_corpus_jsonl(corpus(tmp_path))).save(out)
    (out / MARKER_FILE).unlink()  # what earlier versions wrote
    assert [p.id for p in open_index(out).search("Rome", 1)] == ["b"]
    rc, _, err = cli(capsys, "index", "build", "--corpus", corpus(tmp_path), "--out", out)
    assert rc == 0, err
    assert (out / MARKER_FILE).is_file()


# ------------------------------------------------------------------------------------------- other file writes


def test_atomic_writes_replace_a_planted_link_instead_of_writing_through_it(tmp_path) -> None:
    target = outside(tmp_path)
    for i, write in enumerate(
        (
            lambda p: atomic_write_text(p, "x"),
            lambda p: atomic_write_bytes(p, b"x"),
            lambda p: atomic_write_json(p, {"x": 1}),
            lambda p: dump_config(TrainConfig(), p),
        )
    ):
        path = tmp_path / f"out{i}"
        path.symlink_to(target)
        write(path)
        assert not path.is_symlink() and path.is_file()
        assert target.read_text() == "precious\n"


def test_report_replaces_links_planted_in_the_report_folder(two_steps, tmp_path, capsys) -> None:  # noqa: F811
    target = outside(tmp_path)
    run = copy_run(two_steps, tmp_path / "run")
    report = run / "report"
    report.mkdir(exist_ok=True)
    for name in ("reward_and_val_f1.png", "report.md", "report.html", "cost.png"):
        (report / name).unlink(missing_ok=True)
        (report / name).symlink_to(target)
    rc, _, err = cli(capsys, "report", run)
    assert rc == 0, err
    assert target.read_text() == "precious\n"
    assert not (report / "reward_and_val_f1.png").is_symlink()
    assert (report / "reward_and_val_f1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shutil.rmtree(report)
    report.symlink_to(target.parent, target_is_directory=True)
    before = snapshot(target.parent)
    rc, _, err = cli(capsys, "report", run)
    assert_one_line_error(rc, err, rf"{report}: is a link; pass --out to say where the report goes$")
    assert snapshot(target.parent) == before


def write_questions(path: Path, n: int = 6) -> Path:
    rows = [
        {
            "_id": f"q{i}",
            "question": f"Question {i}?",
            "answer": "yes",
            "type": "bridge",
            "level": "easy",
            "supporting_facts": [],
            "context": [["T", ["text."]]],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_data_split_never_overwrites_its_source_nor_existing_parts(tmp_path, capsys) -> None:
    source = write_questions(tmp_path / "train.jsonl")
    before = snapshot(tmp_path)
    for extra in ([], ["--overwrite"]):
        rc, _, err = cli(
            capsys, "data", "split", "--data", f"hotpotqa:{source}", "--out", tmp_path, "--sizes", "3,2", *extra
        )
        assert_one_line_error(rc, err, rf"{source}: is the source file being read")
        assert snapshot(tmp_path) == before
    out = tmp_path / "parts"
    out.mkdir()
    (out / "val.jsonl").write_text("mine\n")
    rc, _, err = cli(capsys, "data", "split", "--data", f"hotpotqa:{source}", "--out", out, "--sizes", "3,2")
    assert_one_line_error(rc, err, rf"{out / 'val.jsonl'}: already exists; pass --overwrite")
    assert (out / "val.jsonl").read_text() == "mine\n" and not (out / "train.jsonl").exists()
    rc, _, err = cli(
        capsys, "data", "split", "--data", f"hotpotqa:{source}", "--out", out, "--sizes", "3,2", "--overwrite"
    )
    assert rc == 0, err
    assert (
        len((out / "val.jsonl").read_text().splitlines()) == 2
        and snapshot(tmp_path)["train.jsonl"] == before["train.jsonl"]
    )


def test_data_synth_refuses_existing_files_unless_overwrite(tmp_path, capsys) -> None:
    (tmp_path / "corpus.jsonl").write_text("mine\n")
    args = ["data", "synth", "--out", tmp_path, "--train", 5, "--dev", 2]
    rc, _, err = cli(capsys, *args)
    assert_one_line_error(rc, err, rf"{tmp_path / 'corpus.jsonl'}: already exists; pass --overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]
    rc, _, err = cli(capsys, *args, "--overwrite")
    assert rc == 0, err
    assert (tmp_path / "corpus.jsonl").read_text() != "mine\n" and (tmp_path / "world.json").is_file()


# ----------------------------------------------------------------------------------- code named by a run folder


def evil_file(folder: Path) -> Path:
    path = folder / "evil.py"
    path.write_text(EVIL, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "command, cls, name", [("train", TrainConfig, "config.yaml"), ("sft", SFTConfig, "config.yaml")]
)
def test_resume_never_imports_the_code_a_run_folder_names_without_opt_in(tmp_path, capsys, command, cls, name) -> None:
    evil = evil_file(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    dump_config(load_config(cls, None, [f"system={evil}:Evil", f"output_dir={run}"]), run / name)
    rc, _, err = cli(capsys, command, "--resume", run)
    assert_one_line_error(
        rc,
        err,
        rf"{run / name}: system: {evil}:Evil: continuing would import and run the "
        rf"Python file {evil}; if you trust it, add --trust-code \(or --system "
        rf"{evil}:Evil\) to `mhgpo {command} --resume`$",
    )
    assert not (tmp_path / "IMPORTED").exists()
    for opt_in in (["--trust-code"], ["--system", f"{evil}:Evil"]):  # allowed: on to the checkpoint (none here)
        rc, _, err = cli(capsys, command, "--resume", run, *opt_in)
        assert_one_line_error(rc, err, rf"{run}: no checkpoint to resume from")
        assert (tmp_path / "IMPORTED").exists() == (command == "train")  # (sft builds its team after that check)
        (tmp_path / "IMPORTED").unlink(missing_ok=True)
        loader._MODULES.clear()  # (a file is imported once per process)


def test_eval_resume_never_imports_the_code_an_evaluation_folder_names(tmp_path, capsys) -> None:
    evil = evil_file(tmp_path)
    folder = tmp_path / "eval"
    folder.mkdir()
    data = write_questions(tmp_path / "questions.jsonl")
    for system, what in (
        ("evil_module:Evil", "the Python module evil_module"),
        (f"{evil}:Evil", f"the Python file {evil}"),
    ):
        dump_config(
            load_config(
                EvalConfig,
                None,
                [f"system={system}", f"output_dir={folder}", f"data=hotpotqa:{data}", "model=no-such-model"],
            ),
            folder / "eval_config.yaml",
        )
        rc, _, err = cli(capsys, "eval", "--resume", folder)
        assert_one_line_error(
            rc,
            err,
            rf"{folder / 'eval_config.yaml'}: system: {system}: continuing would import "
            rf"and run {what}; if you trust it, add --trust-code",
        )
        assert not (tmp_path / "IMPORTED").exists()
    for opt_in in (["--trust-code"], ["--system", f"{evil}:Evil"]):  # allowed: imported, then the model is missing
        rc, _, err = cli(capsys, "eval", "--resume", folder, *opt_in)
        assert_one_line_error(rc, err, r"no-such-model")
        assert (tmp_path / "IMPORTED").exists()
        (tmp_path / "IMPORTED").unlink()
        loader._MODULES.clear()


# ----------------------------------------------------------------------------------------- resume = the same run


def test_resume_refuses_a_changed_key_and_records_the_changeable_ones(
    two_steps,
    tmp_path,  # noqa: F811
    capsys,
) -> None:
    run = copy_run(two_steps, tmp_path / "run")
    before = snapshot(run)
    rc, _, err = cli(capsys, "train", "--resume", run, "optim.lr=0.5")
    assert_one_line_error(
        rc,
        err,
        rf"optim\.lr: 0\.5 here, but the run in {run} used 0\.01; --resume continues the "
        r"same run \(it may change only steps, budget_minutes, eval_every, save_every, keep_checkpoints, "
        r"max_failures\): leave optim\.lr out, or start a new run$",
    )
    rc, _, err = cli(capsys, "train", "--resume", run, "--output-dir", tmp_path / "other")
    assert_one_line_error(rc, err, rf"output_dir: {tmp_path / 'other'} is not the run being continued")
    assert snapshot(run) == before and not (tmp_path / "other").exists()
    # The same values again, and a changeable key: applied, and recorded in config.yaml and resumes.jsonl.
    rc, _, err = cli(capsys, "train", "--resume", run, "optim.lr=0.01", "--output-dir", run, "steps=3", "eval_every=0")
    assert rc == 0, err
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["steps"] == 3 and saved["eval_every"] == 0 and saved["optim"]["lr"] == 0.01
    rows = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert [(r["step"], r["changed"]) for r in rows] == [(2, {"steps": [2, 3], "eval_every": [2, 0]})]


@pytest.mark.parametrize("planted", ["metrics.jsonl", "rollouts", "checkpoints/step_1", "tensorboard"])
def test_resume_refuses_a_run_folder_with_a_planted_link(two_steps, tmp_path, capsys, planted) -> None:  # noqa: F811
    target = outside(tmp_path)
    run = copy_run(two_steps, tmp_path / "run")
    path = run / planted
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(target if planted.endswith(".jsonl") else target.parent, target_is_directory=path.suffix == "")
    before, outside_before = snapshot(run), snapshot(target.parent)
    rc, _, err = cli(capsys, "train", "--resume", run, "steps=3")
    assert_one_line_error(rc, err, rf"{path}: is a link; a folder that mhgpo continues holds no links")
    assert snapshot(run) == before and snapshot(target.parent) == outside_before


def test_eval_refuses_links_planted_where_it_writes(tmp_path, capsys) -> None:
    target = outside(tmp_path)
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "predictions.jsonl").symlink_to(tmp_path / "elsewhere" / "new.jsonl")  # dangling: not "existing"
    rc, _, err = cli(capsys, "eval", "--output-dir", folder, "--data", "synthetic", "--model", "no-such-model")
    assert_one_line_error(rc, err, rf"{folder / 'predictions.jsonl'}: is a link")
    (folder / "predictions.jsonl").unlink()
    dump_config(load_config(EvalConfig, None, [f"output_dir={folder}"]), folder / "eval_config.yaml")
    (folder / "sub").mkdir()
    (folder / "sub" / "x").symlink_to(target)
    rc, _, err = cli(capsys, "eval", "--resume", folder)
    assert_one_line_error(rc, err, rf"{folder / 'sub' / 'x'}: is a link")
    assert sorted(p.name for p in target.parent.iterdir()) == ["precious.txt"] and target.read_text() == "precious\n"


# ------------------------------------------------------------------------------------ what ranks send each other


def test_ranks_exchange_records_as_json_and_decoding_runs_nothing(tmp_path) -> None:
    import math
    import os
    import pickle

    import numpy as np

    from mhgpo.data.records import Example
    from mhgpo.model.wire import WireError, dumps, loads
    from mhgpo.rl.evaluation import EvalResult
    from mhgpo.rl.tree import Node, RolloutBatch
    from mhgpo.team.loader import RolloutFailure

    example = Example("q1", "Who?", ("Ada", "A. L."), "bridge", ("T",), (("T", "text"),))
    node = Node(
        3,
        0,
        -1,
        "rewriter",
        "llm",
        0,
        [1, 2],
        [3],
        [-0.5],
        "out",
        -0.5,
        {"queries": ("a", "b"), "n": 2},
        ("q1", "rewriter", 0),
        trace={"steps": [["rewriter", "out"]]},
    )
    batch = RolloutBatch(
        [example],
        [node],
        [[None, "reranker"]],
        {"seconds": 1.5},
        [RolloutFailure("q2", "MyTeam", "apply", "x.py:3", "KeyError: 'k'", "answerer")],
    )
    got_batch, stop, values, result = loads(
        dumps([batch, True, (np.arange(3.0), [7]), EvalResult({"f1": 50.0}, [{"id": "q1"}])])
    )
    assert got_batch.examples == [example] and got_batch.failures == batch.failures
    got = got_batch.nodes[0]
    assert math.isnan(got.terminal) and got.group_key == ("q1", "rewriter", 0) and got.info == node.info
    assert dataclasses_equal(got, node) and got_batch.fork_agents == [[None, "reranker"]] and stop is True
    assert values[0].tolist() == [0.0, 1.0, 2.0] and values[0].dtype == np.float64 and values[1] == [7]
    assert result == EvalResult({"f1": 50.0}, [{"id": "q1"}])

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'RAN'}",))

    for hostile in (
        pickle.dumps(Payload()),
        b'{"$dataclass": "Payload", "fields": {}}',
        b'{"$dataclass": "Popen", "fields": {"args": ["touch", "x"]}}',
        b'{"$dataclass": "Node", "fields": {"node_id": 1}}',
    ):
        with pytest.raises(WireError):
            loads(hostile)
    assert not (tmp_path / "RAN").exists()
    with pytest.raises(WireError, match=r"^a Payload cannot be sent between ranks \(JSON-like values only\)$"):
        dumps({"info": Payload()})


def test_only_registered_record_classes_cross_between_ranks() -> None:
    import dataclasses

    from mhgpo.model import wire

    @dataclasses.dataclass
    class Node:  # a class of the same name as the rollout's, not registered
        node_id: int

    with pytest.raises(wire.WireError, match=r"a .*Node cannot be sent between ranks"):
        wire.dumps(Node(1))
    with pytest.raises(ValueError, match="another record type is registered as 'Node'"):
        wire.register(Node)
    with pytest.raises(TypeError, match="is not a dataclass"):
        wire.register(int)
    from mhgpo.rl.tree import Node as RolloutNode

    wire.register(RolloutNode)  # registering the same class again is harmless
    assert wire.DATACLASSES["Node"] is RolloutNode


def dataclasses_equal(a, b) -> bool:
    import dataclasses
    import math

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if not (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))):
            return False
    return True
