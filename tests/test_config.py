"""Typed configs: YAML dumps, key=value overrides, and errors that name the key."""

import pytest

from mhgpo.config import EvalConfig, dump_config, load_config
from mhgpo.records import InputError


def test_defaults_and_overrides():
    cfg = load_config(EvalConfig, None, ["limit=5", "search.top_k=7", "search.answerer.max_new_tokens=9", "model=x"])
    assert cfg.limit == 5 and cfg.search.top_k == 7 and cfg.search.answerer.max_new_tokens == 9 and cfg.model == "x"
    assert cfg.search.rewriter.max_new_tokens == 48  # untouched defaults stay


def test_unknown_key_named():
    with pytest.raises(InputError, match=r"unknown config key search\.topk"):
        load_config(EvalConfig, None, ["search.topk=3"])


def test_bad_value_named():
    with pytest.raises(InputError, match=r"search\.top_k: expected an integer, got 'three'"):
        load_config(EvalConfig, None, ["search.top_k=three"])
    with pytest.raises(InputError, match=r"limit: expected an integer"):
        load_config(EvalConfig, None, ["limit=1.5"])


def test_override_without_equals():
    with pytest.raises(InputError, match="key=value"):
        load_config(EvalConfig, None, ["limit"])


def test_yaml_roundtrip(tmp_path):
    cfg = load_config(EvalConfig, None, ["limit=3", "search.snippet_words=11"])
    path = tmp_path / "c.yaml"
    dump_config(cfg, path)
    assert load_config(EvalConfig, path) == cfg


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("limit: 3\nsearch:\n  top_k: [\n")
    with pytest.raises(InputError, match=r"bad\.yaml:\d+: invalid YAML"):
        load_config(EvalConfig, bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("limmit: 3\n")
    with pytest.raises(InputError, match=r"unknown\.yaml: unknown config key limmit"):
        load_config(EvalConfig, unknown)
    with pytest.raises(InputError, match="config file not found"):
        load_config(EvalConfig, tmp_path / "missing.yaml")
