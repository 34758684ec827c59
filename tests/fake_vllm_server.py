"""A tiny stand-in for vLLM's OpenAI-compatible server, in this process (a thread), for the tests of
`generation.engine=vllm_server` that need no vLLM: it answers `/v1/models`, `/v1/completions` (token ids in, token
ids out as vLLM's ``return_tokens_as_token_ids`` gives them, each with a log-prob), `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, with ``dev_mode`` (vLLM's development mode) `/collective_rpc` (``reload_weights``) and
`/reset_prefix_cache`, records every request, and can be told to answer garbage, to be slow or to fail."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from safetensors import safe_open


class FakeVLLMServer:
    """``tokens(prompt, body) -> list[int]``: the completion of one prompt (default: 3 tokens, the prompt's last id
    + 1, + 2, + 3, modulo ``vocab``); each token's log-prob is ``-0.5``. ``mode``: ``ok``, ``garbage`` (an answer
    that is no completion), ``not_json``, ``slow`` (waits ``delay`` seconds before answering), ``error`` (HTTP 500).
    ``dev_mode``: it answers `/collective_rpc` and `/reset_prefix_cache` (else 404, as vLLM does outside it); each
    ``reload_weights`` is recorded in ``reloaded`` (the path, or the file's tensors' names at that time)."""

    def __init__(
        self, vocab: int = 100, tokens: Any = None, name: str = "mhgpo", port: int = 0, dev_mode: bool = False
    ) -> None:
        self.vocab, self.name, self.mode, self.delay, self.dev_mode = vocab, name, "ok", 0.0, dev_mode
        self.load_delay = 0.0  # seconds each adapter's load takes (as a server busy generating answers it late)
        self.reloaded: list[tuple[str, list[str]]] = []  # (weights_path, names of its model.safetensors' tensors)
        self.tokens = tokens or (lambda prompt, body: [(prompt[-1] + k) % vocab for k in (1, 2, 3)])
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.loaded: dict[str, str] = {}  # adapter name -> its path
        self.events: list[str] = []  # "load NAME" / "unload NAME", in order
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any, raw: bytes | None = None) -> None:
                data = raw if raw is not None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                fake.requests.append((self.path, {}))
                if self.path != "/v1/models":
                    return self._send(404, {"error": "not found"})
                data = [{"id": fake.name, "root": "/models/base", "parent": None}]
                data += [{"id": n, "root": p, "parent": fake.name} for n, p in fake.loaded.items()]
                self._send(200, {"object": "list", "data": data})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.requests.append((self.path, body))
                if fake.mode == "slow":
                    time.sleep(fake.delay)
                if fake.mode == "error":
                    return self._send(500, {"error": "the engine died"})
                if self.path == "/v1/load_lora_adapter":
                    time.sleep(fake.load_delay)
                    if body["lora_name"] in fake.loaded:
                        return self._send(400, {"error": f"{body['lora_name']} is already loaded"})
                    fake.loaded[body["lora_name"]] = body["lora_path"]
                    fake.events.append(f"load {body['lora_name']}")
                    return self._send(200, None, raw=f"Success: LoRA adapter '{body['lora_name']}' added".encode())
                if self.path == "/v1/unload_lora_adapter":
                    if fake.loaded.pop(body["lora_name"], None) is None:
                        return self._send(404, {"error": f"{body['lora_name']} is not loaded"})
                    fake.events.append(f"unload {body['lora_name']}")
                    return self._send(200, None, raw=f"Success: LoRA adapter '{body['lora_name']}' removed".encode())
                if self.path in ("/collective_rpc", "/reset_prefix_cache") and fake.dev_mode:
                    if self.path == "/reset_prefix_cache":
                        fake.events.append("reset_prefix_cache")
                        return self._send(200, {"success": True})
                    path = body["kwargs"]["weights_path"]
                    file = Path(path) / "model.safetensors"
                    names = sorted(safe_open(str(file), "pt").keys()) if file.is_file() else []
                    fake.reloaded.append((path, names))
                    fake.events.append(f"reload {path}")
                    return self._send(200, {"results": [None]})
                if self.path != "/v1/completions":
                    return self._send(404, {"error": "not found"})
                if body["model"] != fake.name and body["model"] not in fake.loaded:
                    return self._send(404, {"error": f"model {body['model']} does not exist"})
                if fake.mode == "not_json":
                    return self._send(200, None, raw=b"<html>oops</html>")
                if fake.mode == "garbage":
                    return self._send(200, {"choices": [{"index": 0, "text": "hello"}]})
                prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
                choices = []
                for i, prompt in enumerate(prompts):
                    if body.get("logprob_token_ids"):
                        wanted = body["logprob_token_ids"]
                        top = [{f"token_id:{w}": -0.25 - 0.01 * len(prompt) - 0.1 * k for k, w in enumerate(wanted)}]
                        logprobs = {"tokens": [f"token_id:{wanted[0]}"], "token_logprobs": [-0.3], "top_logprobs": top}
                    else:
                        ids = fake.tokens(prompt, body)[: body["max_tokens"]]
                        logprobs = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-0.5] * len(ids)}
                    choices.append({"index": i, "text": "", "logprobs": logprobs, "finish_reason": "stop"})
                self._send(
                    200, {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": choices}
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)  # (port 0: a free one)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def completions(self) -> list[dict[str, Any]]:
        return [body for path, body in self.requests if path == "/v1/completions"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeVLLMServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
