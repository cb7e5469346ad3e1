"""`veloxquant serve`: a real server process on 127.0.0.1 driven by the openai client.

The model is a random-init two-layer Llama saved as an mlx-lm model folder with SmolLM2's tokenizer (its
context set to 512 tokens), so outputs are gibberish but deterministic (temperature 0)."""

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

CONTEXT = 512
START_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from veloxquant.models.default import default_model_path

    d = tmp_path_factory.mktemp("tiny_served")
    cfg = {
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "rope_theta": 10000.0,
        "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": True,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**cfg))
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (d / "config.json").write_text(json.dumps(cfg))
    tokenizer_src = default_model_path(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_src / name, d / name)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: Path, recipe: str, *sets: str):
        self.port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "veloxquant.cli",
            "serve",
            recipe,
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--max-tokens",
            "16",
            *[a for s in sets for a in ("--set", s)],
        ]
        self.log = open(model_dir / f"{recipe}-{self.port}.log", "w+")  # noqa: SIM115 (open while it runs)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", timeout=30, max_retries=0
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:  # bounded: up until the model is loaded and the recipe compiled
            assert self.proc.poll() is None, self.text_log()
            try:
                if self.status().get("fingerprint"):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"server did not start in {START_TIMEOUT_S} s:\n{self.text_log()}")

    def request(self, method, path, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def status(self) -> dict:
        code, body = self.request("GET", "/v1/veloxquant/status")
        assert code == 200
        return json.loads(body)

    def last_sequence(self, tokens: int) -> dict:
        """The status's last finished sequence once it is the one of `tokens` tokens: mlx-lm's batched path
        ends the response before it stores the caches (where the status records them), so a bounded wait."""
        deadline = time.monotonic() + 10
        while (last := self.status()["last_sequence"]) is None or last["tokens"] != tokens:
            assert time.monotonic() < deadline, f"no finished sequence of {tokens} tokens recorded: {last}"
            time.sleep(0.05)
        return last

    def chat(self, messages, **kw):
        return self.client.chat.completions.create(
            model="default_model", messages=messages, temperature=0, **{"max_tokens": 8, **kw}
        )

    def text_log(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def kivi(model_dir):
    server = Server(model_dir, "kivi", "window=16", "group=32")
    yield server
    server.stop()


def test_start_log_and_status(kivi):
    status = kivi.status()
    assert status["recipe"] == "kivi" and len(status["fingerprint"]) == 16
    assert status["batched"] is True and status["serving"] == "batched" and status["context"] == CONTEXT
    log = kivi.text_log()
    assert f"recipe 'kivi', fingerprint {status['fingerprint']}" in log
    assert "serving one sequence at a time" not in log


def test_streaming_and_not(kivi):
    messages = [{"role": "user", "content": "Tell me about the sea. " * 6}]
    whole = kivi.chat(messages)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    pieces = [c.choices[0].delta.content or "" for c in kivi.chat(messages, stream=True) if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content  # greedy: the same text either way
    last = kivi.last_sequence(whole.usage.total_tokens)  # the caches' own nbytes, compressed past the window
    assert 0 < last["cache_bytes"] < last["fp16_bytes"]


def test_two_turn_chat_reuses_the_prefix(kivi):
    first = [{"role": "user", "content": "Name three rivers of Europe, please."}]
    reply = kivi.chat(first)
    second = first + [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "And which is longest?"},
    ]
    again = kivi.chat(second)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content
    # a prompt equal to what the server stored: rewound one token, not an empty prefill
    complete = lambda p: kivi.client.completions.create(model="default_model", prompt=p, max_tokens=8, temperature=0)
    text = "The sea was calm and the boats were out"
    repeat = complete(text + complete(text).choices[0].text)
    assert 0 < repeat.usage.prompt_tokens_details.cached_tokens < repeat.usage.prompt_tokens
    assert repeat.usage.completion_tokens == 8


def test_eight_concurrent_clients(kivi):
    """kivi batched: 8 clients at once (prompts of 5 to 166 words, past the 16-token window, so rows spill
    and code at different steps) get the answers each gets alone."""
    prompts = [("word " * (5 + 23 * i)).strip() for i in range(8)]
    ask = lambda p: kivi.chat([{"role": "user", "content": p}])
    alone = [ask(p).choices[0].message.content for p in prompts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, prompts))
    wall = time.perf_counter() - t0
    assert all(r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length" for r in replies)
    assert len({r.usage.prompt_tokens for r in replies}) == 8
    assert [r.choices[0].message.content for r in replies] == alone
    print(f"8 concurrent clients answered in {wall:.2f} s")


def test_bad_requests_leave_the_server_serving(kivi):
    headers = {"Content-Type": "application/json"}
    code, body = kivi.request("POST", "/v1/chat/completions", b'{"messages": [', headers)
    assert code == 400 and b"Invalid JSON" in body
    with pytest.raises(openai.BadRequestError) as e:
        kivi.chat([{"role": "user", "content": "hi"}], extra_body={"recipe": "h2o"})
    assert "recipe is fixed" in e.value.response.text
    with pytest.raises(openai.APIStatusError) as e:
        kivi.chat([{"role": "user", "content": "word " * 600}])
    assert 400 <= e.value.status_code < 500 and "more than the model's context of 512" in e.value.response.text
    # a client that leaves mid-stream: the server stops that sequence and goes on
    body = json.dumps({"messages": [{"role": "user", "content": "go on"}], "stream": True, "max_tokens": 400})
    with socket.create_connection(("127.0.0.1", kivi.port), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        assert sock.recv(4096).startswith(b"HTTP/1.0 200")
    assert kivi.chat([{"role": "user", "content": "still there?"}]).usage.completion_tokens == 8
    code, _ = kivi.request("GET", "/health")
    assert code == 200


def test_eviction_recipe_prefix_reuse_is_exact(model_dir):
    """h2o is served batched, and its caches cannot be trimmed: the server may only continue a stored cache
    whose tokens are a whole prefix of the new prompt (merged into the batch with its evicted history). Its
    second answer equals one cache continued in-process the same way; 6 concurrent clients whose prompts
    are cut at different steps get what each gets alone."""
    import mlx_lm
    from mlx_lm.models.cache import can_trim_prompt_cache

    import veloxquant

    sets = ["budget=8", "sinks=2"]
    server = Server(model_dir, "h2o", *sets)
    first = "The sea was calm and the boats were out"
    try:
        assert server.status()["batched"] is True  # each row its own budget (runtime/eviction/batch_heads.py)
        assert "serving one sequence at a time" not in server.text_log()
        complete = lambda p: server.client.completions.create(
            model="default_model", prompt=p, max_tokens=8, temperature=0
        )
        prompts = [("sea " * (3 + 17 * i)).strip() + f" {i}" for i in range(6)]
        alone = [complete(p).choices[0].text for p in prompts]
        with ThreadPoolExecutor(6) as pool:
            assert [r.choices[0].text for r in pool.map(complete, prompts)] == alone
        reply = complete(first)
        second = first + reply.choices[0].text + " More words here."
        again = complete(second)
        server.last_sequence(again.usage.total_tokens)
        # the stored tokens exactly (an untrimmable hit with nothing left to prefill): answered afresh
        repeat = complete(first + reply.choices[0].text)
        assert repeat.usage.prompt_tokens_details.cached_tokens == 0 and repeat.choices[0].text
    finally:
        server.stop()
    model, tokenizer = mlx_lm.load(str(model_dir))
    caches = veloxquant.make_prompt_cache(model, "h2o", sets=sets)
    p1, p2 = tokenizer.encode(first), tokenizer.encode(second)
    out1 = list(mlx_lm.stream_generate(model, tokenizer, p1, max_tokens=8, prompt_cache=caches))
    g1 = [r.token for r in out1]
    assert "".join(r.text for r in out1) == reply.choices[0].text  # the server's detokenizer, as here
    assert not can_trim_prompt_cache(caches)  # past the budget: evicted
    key = p1 + g1
    assert p2[: len(key)] == key, "the second prompt must re-tokenize to the first turn's tokens (pick another)"
    assert again.usage.prompt_tokens_details.cached_tokens == len(key)  # LRUPromptCache's shorter-prefix reuse
    out2 = mlx_lm.stream_generate(model, tokenizer, p2[len(key) :], max_tokens=8, prompt_cache=caches)
    assert again.choices[0].text == "".join(r.text for r in out2)
    fresh = veloxquant.make_prompt_cache(model, "h2o", sets=sets)
    out3 = mlx_lm.stream_generate(model, tokenizer, key, max_tokens=8, prompt_cache=fresh)
    assert repeat.choices[0].text == "".join(r.text for r in out3)
    veloxquant.uninstall(model)


def test_recipe_errors_exit_before_the_server_starts(model_dir):
    cmd = [
        sys.executable,
        "-m",
        "veloxquant.cli",
        "serve",
        "kivi",
        "--model",
        str(model_dir),
        "--port",
        str(_free_port()),
        "--set",
        "bitz=3",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "recipe 'kivi' has no parameter 'bitz'" in done.stderr
    assert "Starting httpd" not in done.stderr + done.stdout


def test_the_batched_path_is_off_for_a_refused_recipe(model_dir):
    """mlx-lm's server takes its BatchGenerator path only when the provider's is_batchable is true."""
    from veloxquant.runtime import uninstall
    from veloxquant.serve.server import RecipeModelProvider, server_args

    provider = RecipeModelProvider(server_args(str(model_dir)), "adakv")
    model, _ = provider.load("default_model")
    try:
        assert provider.is_batchable is False and "'adakv' does not batch" in provider.serial_reason
        assert len(model.make_cache()) == 2 and model.make_cache()[0].fingerprint == provider.plan.fingerprint
        with pytest.raises(ValueError, match="ask for model 'default_model'"):
            provider.load("another/model")
    finally:
        uninstall(model)


@pytest.fixture(scope="module")
def fp16(model_dir):
    server = Server(model_dir, "fp16")
    yield server
    server.stop()


def test_fp16_is_served_batched(fp16):
    status = fp16.status()
    assert status["batched"] is True and status["serving"] == "batched"
    assert "serving one sequence at a time" not in fp16.text_log()


def test_fp16_concurrent_clients_answer_as_one_at_a_time(fp16):
    """8 clients at once with prompts of different lengths (a batch with ragged rows, sequences joining as
    they arrive and leaving as they finish) get what each gets alone; a bad request among them is a 4xx."""
    prompts = [("word " * (3 + 29 * i)).strip() + f" {i}" for i in range(8)]
    ask = lambda p: fp16.chat([{"role": "user", "content": p}])
    alone = [ask(p).choices[0].message.content for p in prompts]
    headers = {"Content-Type": "application/json"}
    with ThreadPoolExecutor(9) as pool:
        replies = [pool.submit(ask, p) for p in prompts]
        bad = pool.submit(fp16.request, "POST", "/v1/chat/completions", b'{"messages": [', headers)
        replies = [r.result() for r in replies]
        assert bad.result()[0] == 400
    assert len({r.usage.prompt_tokens for r in replies}) == 8
    assert [r.choices[0].message.content for r in replies] == alone
    assert all(r.usage.completion_tokens == 8 for r in replies)


def test_fp16_two_turn_chat_merges_a_stored_prefix(fp16):
    """The second turn's cache comes from the prefix cache (a cache holding a prompt, merged into the batch)."""
    first = [{"role": "user", "content": "Name three rivers of Europe, please."}]
    reply = fp16.chat(first)
    second = first + [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "And which is longest?"},
    ]
    with ThreadPoolExecutor(2) as pool:  # another sequence in the batch meanwhile
        other = pool.submit(fp16.chat, [{"role": "user", "content": "word " * 40}])
        again = pool.submit(fp16.chat, second)
        other, again = other.result(), again.result()
    assert again.usage.prompt_tokens_details.cached_tokens > 0 and other.usage.completion_tokens == 8
    assert again.choices[0].message.content == fp16.chat(second).choices[0].message.content
