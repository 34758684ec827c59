"""generation.engine=vllm_server's client (`mhgpo.model.vllm_server`) against a stand-in server in this process
(tests/fake_vllm_server.py; no vLLM): what a request asks for, the versioned adapters and their unloading once no
generation uses them, and the one-line stops of a server that answers garbage, fails, is down or is slow."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
import torch
from fake_vllm_server import FakeVLLMServer
from safetensors.torch import save_file

from mhgpo.errors import ServiceError
from mhgpo.model.generation import SamplingParams
from mhgpo.model.vllm_server import ServerGenerator, adapter_name, server_command, server_environment

EOS = 7


class Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == EOS))


def _client(*servers: FakeVLLMServer, timeout: float = 5.0, adapter_dir: Path | None = None) -> ServerGenerator:
    return ServerGenerator(
        [s.url for s in servers], Tokenizer(), [EOS], timeout=timeout, vocab_size=100, adapter_dir=adapter_dir, tag=""
    )


def _adapter(folder: Path, value: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"lora_A.weight": torch.full((2, 2), value)}, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture
def server():
    with FakeVLLMServer() as s:
        yield s


def test_a_request_asks_for_token_ids_and_their_log_probs(server: FakeVLLMServer) -> None:
    client = _client(server)
    out = client.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=2, temperature=0.7, top_p=0.8))
    (body,) = server.completions()
    assert body == {
        "model": "mhgpo",
        "prompt": [[1, 2, 3], [4, 5]],
        "max_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.8,
        "n": 1,
        "logprobs": 0,
        "stop_token_ids": [EOS],
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": True,
    }
    assert [g.output_ids for g in out] == [[4, 5], [6, 7]]
    assert [g.logprobs for g in out] == [[-0.5, -0.5], [-0.5, -0.5]]
    assert [g.finished for g in out] == [False, True]  # (the second ended with EOS)
    assert [g.prompt_ids for g in out] == [[1, 2, 3], [4, 5]]
    assert out[1].text == "6"
    greedy = client.generate([[1]], SamplingParams(max_new_tokens=3, temperature=0.0, top_p=0.5))
    assert server.completions()[-1]["top_p"] == 1.0 and server.completions()[-1]["temperature"] == 0.0
    assert greedy[0].output_ids == [2, 3, 4]


def test_seeded_each_prompt_is_a_request_with_its_own_seed_from_the_stream(server: FakeVLLMServer) -> None:
    import numpy as np

    from mhgpo.model.vllm_engine import SEED_STREAM, RequestSeeds

    client = _client(server)
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_p=0.9)
    with client.seeded((3, 8, 0)):
        out = client.generate([[1, 2], [4], [5, 6]], params)
        client.generate([[9]], params)  # the next call takes the stream's next seed
        client.generate([[9]], SamplingParams(max_new_tokens=2, temperature=0.0))  # greedy: one request, no seed
    stream = np.random.default_rng([3, 8, 0, SEED_STREAM]).integers(0, 2**63 - 1, size=6, dtype="int64")
    bodies = server.completions()
    assert sorted((b["prompt"], b["seed"]) for b in bodies[:3]) == sorted(
        [([[1, 2]], int(stream[0])), ([[4]], int(stream[1])), ([[5, 6]], int(stream[2]))]
    )
    assert (bodies[3]["prompt"], bodies[3]["seed"]) == ([[9]], int(stream[3]))
    assert bodies[4]["prompt"] == [[9]] and "seed" not in bodies[4]
    assert [g.output_ids for g in out] == [[3, 4], [5, 6], [7, 8]]  # in the order of the prompts
    client.generate([[1], [2]], params)  # outside it: one request, the server's own stream
    assert server.completions()[-1]["prompt"] == [[1], [2]] and "seed" not in server.completions()[-1]
    seeds = RequestSeeds()
    assert seeds.take(2) is None
    with seeds.seeded((3, 8, 0)):
        assert seeds.take(5) == [int(x) for x in stream[:5]]
        with seeds.seeded((3, 9, 0)):  # (nested: another batch's stream, then this one's again, where it was)
            assert seeds.take(1) != [int(stream[5])]
        assert seeds.take(1) == [int(stream[5])]
    took = []
    with seeds.seeded((3, 8, 0)):
        thread = threading.Thread(target=lambda: took.append(seeds.take(1)))  # another thread: no stream of its own
        thread.start()
        thread.join()
        assert took == [None] and seeds.take(1) == [int(stream[0])]


def test_each_requests_answer_is_reported_as_it_comes_with_its_prompts_indices(server: FakeVLLMServer) -> None:
    """on_chunk (the rollout's pipeline): called in the caller's thread on every request's generations, with the
    indices of its prompts; together they are the call's results, whatever order the answers came in."""
    client = _client(server)
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_p=0.9)
    for seeded in (True, False):
        chunks: list[tuple[list[int], list[list[int]], str]] = []

        def report(idx: list[int], gens: list, chunks: list = chunks) -> None:
            chunks.append((idx, [g.output_ids for g in gens], threading.current_thread().name))

        with client.seeded((3, 8, 0)) if seeded else contextlib.nullcontext():
            out = client.generate([[1, 2], [4], [5, 6]], params, on_chunk=report)
        assert sorted(len(idx) for idx, _, _ in chunks) == ([1, 1, 1] if seeded else [3])  # a request a prompt
        by_index = {i: ids for idx, gens, _ in chunks for i, ids in zip(idx, gens)}
        assert by_index == dict(enumerate(g.output_ids for g in out))
        assert {name for *_, name in chunks} == {threading.current_thread().name}
    with FakeVLLMServer() as a, FakeVLLMServer() as b:  # two servers, unseeded: a part each
        chunks = []
        _client(a, b).generate(
            [[10], [20], [30]],
            SamplingParams(max_new_tokens=1),
            on_chunk=lambda i, g: chunks.append((i, [x.output_ids for x in g])),
        )
        assert sorted(chunks) == [([0, 1], [[11], [21]]), ([2], [[31]])]


def test_prompts_are_shared_among_the_servers_in_order() -> None:
    with FakeVLLMServer() as a, FakeVLLMServer() as b:
        client = _client(a, b)
        out = client.generate([[10], [20], [30]], SamplingParams(max_new_tokens=1))
        assert [body["prompt"] for body in a.completions()] == [[[10], [20]]]
        assert [body["prompt"] for body in b.completions()] == [[[30]]]
        assert [g.output_ids for g in out] == [[11], [21], [31]]


def test_adapters_are_served_under_versioned_names_and_unloaded_once_unused(
    server: FakeVLLMServer, tmp_path: Path
) -> None:
    client = _client(server, adapter_dir=tmp_path)
    v1 = _adapter(tmp_path / "adapters-v1", 1.0)
    client.set_adapters({None: v1}, 1)
    assert server.loaded == {"shared-v1": str(v1.resolve())}
    client.generate([[1]], SamplingParams(max_new_tokens=1))
    assert server.completions()[-1]["model"] == "shared-v1"
    assert client.held().version == 1 and client.held().adapters[None] == client._digests["shared-v1"]

    with client.pinned() as version:  # a rollout batch on version 1 while version 2 is handed over
        assert version == 1
        client.set_adapters({None: _adapter(tmp_path / "adapters-v2", 2.0)}, 2)
        assert server.events == ["load shared-v1", "load shared-v2"]  # v1 still in use: not unloaded
        client.generate([[1]], SamplingParams(max_new_tokens=1))
        assert server.completions()[-1]["model"] == "shared-v1"  # the pinned batch stays on its version
        assert client.in_use() == {"shared-v1": 1}
    assert server.events == ["load shared-v1", "load shared-v2", "unload shared-v1"]
    assert not v1.exists()  # its folder goes with it
    client.generate([[1]], SamplingParams(max_new_tokens=1))
    assert server.completions()[-1]["model"] == "shared-v2"
    client.set_adapters({None: _adapter(tmp_path / "adapters-v3", 3.0)}, 3)  # nothing uses v2: unloaded at once
    assert server.events[-2:] == ["load shared-v3", "unload shared-v2"]
    assert set(server.loaded) == {"shared-v3"} and client.in_use() == {}


def test_one_adapter_per_agent_each_agent_samples_with_its_own(server: FakeVLLMServer, tmp_path: Path) -> None:
    client = _client(server, adapter_dir=tmp_path)
    folders = {a: _adapter(tmp_path / "adapters-v4" / a, v) for a, v in (("Rewriter", 1.0), ("Answerer", 2.0))}
    client.set_adapters(folders, 4)
    assert set(server.loaded) == {"Rewriter-v4", "Answerer-v4"} == {adapter_name(a, 4) for a in folders}
    client.generate([[1]], SamplingParams(max_new_tokens=1, agent="Answerer"))
    assert server.completions()[-1]["model"] == "Answerer-v4"
    client.set_adapters({a: _adapter(tmp_path / "adapters-v5" / a, 3.0) for a in folders}, 5)
    assert set(server.loaded) == {"Rewriter-v5", "Answerer-v5"}
    assert not (tmp_path / "adapters-v4").exists()


def test_score_asks_for_each_position_of_every_output_at_once(server: FakeVLLMServer) -> None:
    scored = _client(server).score([[1, 2], [3]], [[5, 6], [4]], temperature=0.7)
    bodies = server.completions()
    assert [b["prompt"] for b in bodies] == [[[1, 2], [3]], [[1, 2, 5]]]
    assert [b["logprob_token_ids"] for b in bodies] == [[4, 5], [6]]  # each row reads its own token's
    assert all(b["max_tokens"] == 1 and b["top_p"] == 1.0 and b["temperature"] == 0.7 for b in bodies)
    # (the stand-in's log-prob of the k-th id asked for after a prompt of n tokens: -0.25 - 0.01 n - 0.1 k)
    assert scored == [[pytest.approx(-0.37), pytest.approx(-0.28)], [pytest.approx(-0.26)]]


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("garbage", "malformed answer to /v1/completions: a choice without its tokens' log-probs"),
        ("not_json", "malformed answer to /v1/completions: not JSON"),
        ("error", "/v1/completions answered HTTP 500"),
    ],
)
def test_a_server_that_answers_garbage_or_fails_raises_one_line_naming_it(
    server: FakeVLLMServer, mode: str, says: str
) -> None:
    client = _client(server)
    server.mode = mode
    with pytest.raises(ServiceError) as info:
        client.generate([[1]], SamplingParams(max_new_tokens=1))
    assert str(info.value).startswith(f"generation server {server.url}: ")
    assert says in str(info.value) and "\n" not in str(info.value)


def test_tokens_outside_the_vocabulary_or_too_many_are_refused() -> None:
    with FakeVLLMServer(tokens=lambda prompt, body: [500]) as s:
        with pytest.raises(ServiceError, match=r"a token id outside the vocabulary \(0\.\.99\)"):
            _client(s).generate([[1]], SamplingParams(max_new_tokens=1))
    with FakeVLLMServer(tokens=lambda prompt, body: [1, 2, 3, 4]) as s:
        s.tokens = lambda prompt, body: [1, 2, 3, 4]
        client = _client(s)
        client.session.request = _ignoring_max_tokens(client.session.request)
        with pytest.raises(ServiceError, match="4 tokens, more than the 2 asked for"):
            client.generate([[1]], SamplingParams(max_new_tokens=2))


def _ignoring_max_tokens(request):
    def send(method, url, json=None, **kw):
        if json and "max_tokens" in json:
            json = {**json, "max_tokens": 99}
        return request(method, url, json=json, **kw)

    return send


def test_a_server_that_is_down_is_named() -> None:
    server = FakeVLLMServer()
    url = server.url
    server.close()
    with pytest.raises(ServiceError, match=f"generation server {url}: cannot connect .*mhgpo serve-generation"):
        ServerGenerator([url], Tokenizer(), [EOS], timeout=2.0)


def test_a_slow_server_stops_the_call_at_its_timeout_naming_the_url_and_the_key(server: FakeVLLMServer) -> None:
    client = _client(server, timeout=0.5)
    server.mode, server.delay = "slow", 5.0
    started = time.perf_counter()
    with pytest.raises(ServiceError) as info:
        client.generate([[1]], SamplingParams(max_new_tokens=1))
    assert time.perf_counter() - started < 2.5
    assert str(info.value) == (
        f"generation server {server.url}: no answer to /v1/completions within generation.server_timeout=0.5 s"
    )


def test_generations_in_flight_hold_their_adapter_across_threads(server: FakeVLLMServer, tmp_path: Path) -> None:
    client = _client(server, adapter_dir=tmp_path)
    client.set_adapters({None: _adapter(tmp_path / "adapters-v1", 1.0)}, 1)
    server.mode, server.delay = "slow", 0.6
    thread = threading.Thread(target=lambda: client.generate([[1]], SamplingParams(max_new_tokens=1)))
    thread.start()
    time.sleep(0.2)
    assert client.in_use() == {"shared-v1": 1}
    server.mode = "ok"
    client.set_adapters({None: _adapter(tmp_path / "adapters-v2", 2.0)}, 2)
    assert "unload shared-v1" not in server.events  # the generation in flight still uses it
    thread.join()
    assert server.events[-1] == "unload shared-v1"


def test_waited_seconds_count_the_threads_hand_overs_and_scoring_not_generation(
    server: FakeVLLMServer, tmp_path: Path
) -> None:
    client = _client(server, adapter_dir=tmp_path)
    server.load_delay = 0.3
    client.set_adapters({None: _adapter(tmp_path / "adapters-v1", 1.0)}, 1)
    after_load = client.waited_seconds()
    assert 0.3 <= after_load < 0.3 + 1.0
    server.mode, server.delay = "slow", 0.3  # every request answered 0.3 s late: a generation, then a scoring
    client.generate([[1]], SamplingParams(max_new_tokens=1))
    assert client.waited_seconds() == after_load
    client.score([[1]], [[2]])
    assert client.waited_seconds() - after_load >= 0.3
    server.mode = "ok"
    other = threading.Thread(target=lambda: client.set_adapters({None: _adapter(tmp_path / "adapters-v2", 2.0)}, 2))
    before = client.waited_seconds()
    other.start()
    other.join()
    assert server.loaded == {"shared-v2": str((tmp_path / "adapters-v2").resolve())}
    assert client.waited_seconds() == before  # another thread's hand-over is its own wait


def test_each_run_tags_its_adapters_names(server: FakeVLLMServer, tmp_path: Path) -> None:
    """A server outlives runs: two runs (or a run and its resumption) load their versions under names of their own."""
    first = ServerGenerator([server.url], Tokenizer(), [EOS], adapter_dir=tmp_path)
    second = ServerGenerator([server.url], Tokenizer(), [EOS], adapter_dir=tmp_path)
    assert first.suffix != second.suffix and len(first.suffix) == 7
    first.set_adapters({None: _adapter(tmp_path / "a-v1", 1.0)}, 1)
    second.set_adapters({None: _adapter(tmp_path / "b-v1", 1.0)}, 1)
    assert set(server.loaded) == {"shared-v1" + first.suffix, "shared-v1" + second.suffix}


def test_full_weights_are_written_once_and_reloaded_in_place_on_every_server(tmp_path: Path) -> None:
    """Full fine-tuning: every tensor in one file of its version's folder (a tensor two names share written once),
    each server told to reload from there and then to empty its prefix cache; the previous version's folder goes;
    closing gives each server back the weights it was started on (its listed root)."""
    with FakeVLLMServer(dev_mode=True) as a, FakeVLLMServer(dev_mode=True) as b:
        client = _client(a, b, adapter_dir=tmp_path)
        embed = torch.ones(4, 2)
        named = [("embed.weight", embed), ("norm.weight", torch.zeros(2)), ("lm_head.weight", embed)]
        client.load_weights(iter(named), 1)
        v1 = tmp_path / "weights-v1"
        for server in (a, b):
            assert server.reloaded == [(str(v1.resolve()), ["embed.weight", "norm.weight"])]
            assert server.events == [f"reload {v1.resolve()}", "reset_prefix_cache"]
        assert client.version == 1 and client.held().version == 1 and client.held().adapters == {}
        client.load_weights(iter([("embed.weight", 2 * embed), ("norm.weight", torch.ones(2))]), 2)
        assert not v1.exists() and (tmp_path / "weights-v2" / "model.safetensors").is_file()
        assert a.reloaded[-1][0] == str((tmp_path / "weights-v2").resolve())
        client.close()
        for server in (a, b):
            assert server.events[-2:] == ["reload /models/base", "reset_prefix_cache"]
        assert not (tmp_path / "weights-v2").exists()


def test_a_server_that_takes_no_full_weights_says_how_to_start_one(server: FakeVLLMServer, tmp_path: Path) -> None:
    client = _client(server, adapter_dir=tmp_path)
    with pytest.raises(ServiceError) as info:
        client.load_weights(iter([("norm.weight", torch.zeros(2))]), 0)
    assert str(info.value) == (
        f"generation server {server.url}: it takes no full weights (no /collective_rpc); start it with mhgpo "
        f"serve-generation --full-weights (vLLM's development mode), or train LoRA adapters (lora.enabled=true)"
    )


def test_full_fine_tuning_on_a_server_is_one_process() -> None:
    from types import SimpleNamespace

    from mhgpo.errors import InputError
    from mhgpo.model.vllm_server import build_server_generator

    with pytest.raises(InputError, match=r"^lora.enabled: full fine-tuning on a generation server runs in one process"):
        build_server_generator(spec="m", loaded=None, generation=None, ranks=SimpleNamespace(world=2, rank=0))


def test_the_server_command_samples_as_mhgpo_needs() -> None:
    command = server_command(
        "python", "/m", dtype="bfloat16", seed=3, host="0.0.0.0", port=9000, lora_rank=12, adapters=8
    )
    line = " ".join(command)
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    for part in (
        "--model /m",
        "--dtype bfloat16",
        "--seed 3",
        "--port 9000",
        "--logprobs-mode processed_logits",
        "--logits-processors mhgpo.model.vllm_processors:LogSoftmax "
        "mhgpo.model.vllm_processors:LogSoftmaxAtTemperature",
        "--enable-lora --max-lora-rank 16 --max-loras 8 --max-cpu-loras 8",
        "--enable-prefix-caching",
        "--no-enable-chunked-prefill",
    ):
        assert part in line
    env = server_environment(1.6, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert server_environment(1.6, {}, full_weights=True)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in env


def test_serve_generation_full_weights_turns_on_the_development_mode_and_warns_off_the_loopback(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mhgpo.cli.main import main

    base = ["serve-generation", "--model", str(tiny_model_dir), "--precision", "fp32", "--port", "0", "--dry-run"]
    assert main(base) == 0
    out, err = capsys.readouterr()
    assert "VLLM_SERVER_DEV_MODE" not in out and "warning" not in err
    assert main([*base, "--full-weights"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_CPU_KVCACHE_SPACE=4 VLLM_SERVER_DEV_MODE=1 ")
    assert "warning" not in err  # (the loopback)
    assert main([*base, "--full-weights", "--host", "0.0.0.0"]) == 0
    err = capsys.readouterr().err
    assert "mhgpo: warning: --full-weights on 0.0.0.0: vLLM's development mode lets any client" in err


def test_waiting_for_a_server_returns_once_it_answers_and_names_the_log_when_it_exits_or_stays_silent(
    server: FakeVLLMServer, tmp_path: Path
) -> None:
    from mhgpo.model.vllm_server import wait_until_serving

    class Process:
        def __init__(self, code: int | None) -> None:
            self.returncode, self.killed = code, False

        def poll(self) -> int | None:
            return self.returncode

        def kill(self) -> None:
            self.killed = True

    log = tmp_path / "server.log"
    wait_until_serving(Process(None), server.url, 5, log)  # answers: returns at once
    with pytest.raises(ServiceError, match=f"exited \\(3\\); its log: {log}"):
        wait_until_serving(Process(3), server.url, 5, log)
    silent = Process(None)
    with pytest.raises(ServiceError, match=f"did not answer http://127.0.0.1:9 within 0 s; its log: {log}"):
        wait_until_serving(silent, "http://127.0.0.1:9", 0.1, log)
    assert silent.killed
