"""The reference inference server over real HTTP on loopback, with two tiny models as two
weights versions: OpenAI-shaped completions, logprobs that match a forward pass, and
reloads that never mix versions within a request."""

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from datetime import datetime

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rft_serving import serve
from tests.fixtures.models import save_tiny_model

torch.set_num_threads(1)
PROMPTS = ["1+2=", "3*4=", "A?B", "77-", "9", "C=D+"]


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """version -> (dir, model, tokenizer): two differently seeded tiny models."""
    root = tmp_path_factory.mktemp("weights")
    out = {}
    for v in (0, 1):
        path = save_tiny_model(root / f"v{v}", seed=v)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        out[v] = (str(path), model, AutoTokenizer.from_pretrained(str(path)))
    return out


def call(url, path, body=None, raw=None):
    """-> (status, headers, json). `raw` sends bytes as they are."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


_greedy_cache = {}


def greedy(versions, version, prompt, k):
    """What `model.generate` produces greedily, eos stripped (the server's token_ids)."""
    key = (version, prompt, k)
    if key not in _greedy_cache:
        _, model, tok = versions[version]
        ids = tok(prompt)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=k, do_sample=False)
        new = out[0, len(ids):].tolist()
        _greedy_cache[key] = new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
    return _greedy_cache[key]


def completion(server, **body):
    status, headers, out = call(server.url, "/v1/completions", body)
    assert status == 200, out
    assert headers["X-RFT-Weights-Version"] == str(out["weights_version"])
    return out


def test_not_ready_until_weights_load_then_ready(server, versions):
    status, _, body = call(server.url, "/health")
    assert (status, body) == (503, {"status": "loading", "version": None})
    status, _, body = call(server.url, "/v1/completions", {"prompt": "1"})
    assert status == 503 and "no weights" in body["error"]["message"]
    assert call(server.url, "/weights")[2] == {"version": None, "path": None, "loaded_at": None,
                                                "load_seconds": None, "loading": False, "adapter": False, "base": None}

    status, _, body = call(server.url, "/weights/load", {"path": versions[0][0], "version": 0})
    assert status == 200 and body["version"] == 0 and body["load_seconds"] > 0
    assert call(server.url, "/health")[:3:2] == (200, {"status": "ok", "version": 0})
    w = call(server.url, "/weights")[2]
    assert (w["version"], w["path"], w["loading"]) == (0, versions[0][0], False)
    assert datetime.fromisoformat(w["loaded_at"]).tzinfo and w["load_seconds"] > 0
    models = call(server.url, "/v1/models")[2]
    assert models["data"] == [{"id": "policy", "object": "model", "owned_by": "rft", "weights_version": 0}]
    # Loading what is already served is a no-op.
    assert server.load(versions[0][0], 0)[0] == 0.0


def test_completions_shape_order_and_greedy_match_generate(server, versions):
    server.load(versions[0][0], 0)
    tok = versions[0][2]
    out = completion(server, prompt=PROMPTS[:3], n=2, max_tokens=10, temperature=0)
    assert out["object"] == "text_completion" and out["model"] == "policy"
    assert out["id"].startswith("cmpl-") and out["weights_version"] == 0
    assert out["prompt_token_ids"] == [tok(p)["input_ids"] for p in PROMPTS[:3]]
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for i, c in enumerate(out["choices"]):  # prompt-major: index = p * n + j
        assert c["token_ids"] == greedy(versions, 0, PROMPTS[i // 2], 10)
        assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True)
        assert c["finish_reason"] == ("length" if len(c["token_ids"]) == 10 else "stop")
        assert c["logprobs"] is None
    num_completion = sum(len(c["token_ids"]) for c in out["choices"])
    num_prompt = sum(map(len, out["prompt_token_ids"]))  # once per prompt, not per sample
    assert out["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                            "total_tokens": num_prompt + num_completion}


def test_sampling_n_max_tokens_and_seed(server, versions):
    server.load(versions[0][0], 0)
    body = dict(prompt="1+2=", n=5, max_tokens=7, temperature=1.0, top_p=0.9, seed=1234)
    first, again = completion(server, **body), completion(server, **body)
    ids = [c["token_ids"] for c in first["choices"]]
    assert len(ids) == 5 and all(len(t) <= 7 for t in ids)
    assert ids == [c["token_ids"] for c in again["choices"]]  # same seed, same samples
    assert len({tuple(t) for t in ids}) > 1  # the n samples are distinct draws
    other = completion(server, **{**body, "seed": 99})
    assert [c["token_ids"] for c in other["choices"]] != ids


def test_logprobs_are_raw_logits_of_the_chosen_tokens(server, versions):
    server.load(versions[0][0], 0)
    _, model, tok = versions[0]
    out = completion(server, prompt=["3*4=", "A?B"], n=3, max_tokens=8, temperature=0.7,
                     top_p=0.8, seed=5, logprobs=0)
    for i, c in enumerate(out["choices"]):
        prompt = out["prompt_token_ids"][i // 3]
        ids = torch.tensor([prompt + c["token_ids"]])
        with torch.inference_mode():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        expect = logp[len(prompt) - 1:-1].gather(1, torch.tensor(c["token_ids"])[:, None])[:, 0]
        assert c["logprobs"]["tokens"] == tok.convert_ids_to_tokens(c["token_ids"])
        assert torch.allclose(torch.tensor(c["logprobs"]["token_logprobs"]), expect, atol=1e-4)


def test_the_eos_that_ended_a_sample_is_reported_with_its_raw_logprob(server, versions):
    server.load(versions[0][0], 0)
    _, model, tok = versions[0]
    out = completion(server, prompt="1+1=", n=8, max_tokens=60, temperature=1.0, seed=3, logprobs=0)
    stopped = [c for c in out["choices"] if c["finish_reason"] == "stop"]
    assert stopped, "seeded sampling should end some samples with eos"
    for c in stopped:
        assert c["stop_token_id"] == tok.eos_token_id and tok.eos_token_id not in c["token_ids"]
        ids = torch.tensor([out["prompt_token_ids"][0] + c["token_ids"]])
        with torch.inference_mode():
            expect = torch.log_softmax(model(ids).logits[0, -1].float(), -1)[c["stop_token_id"]]
        assert abs(c["stop_token_logprob"] - float(expect)) < 1e-4
    assert all(c["stop_token_id"] is None for c in out["choices"] if c["finish_reason"] == "length")


def test_stop_string_truncates_text(server, versions):
    server.load(versions[0][0], 0)
    text = versions[0][2].decode(greedy(versions, 0, "1+2=", 12), skip_special_tokens=True)
    stop = text[2]
    c = completion(server, prompt="1+2=", max_tokens=12, temperature=0, stop=[stop, "@@"])["choices"][0]
    assert (c["text"], c["finish_reason"]) == (text[:text.index(stop)], "stop")
    # token_ids end with the token that completed the stop string.
    assert c["token_ids"] == greedy(versions, 0, "1+2=", 12)[:text.index(stop) + 1]


def test_reload_switches_model_and_a_failed_load_keeps_the_old(server, versions, tmp_path):
    server.load(versions[0][0], 0)
    assert completion(server, prompt="9", max_tokens=10, temperature=0)["choices"][0]["token_ids"] \
        == greedy(versions, 0, "9", 10)
    status, _, body = call(server.url, "/weights/load", {"path": versions[1][0], "version": 1})
    assert status == 200 and body["version"] == 1
    out = completion(server, prompt="9", max_tokens=10, temperature=0)
    assert out["weights_version"] == 1
    assert out["choices"][0]["token_ids"] == greedy(versions, 1, "9", 10) != greedy(versions, 0, "9", 10)

    bad = tmp_path / "corrupt"
    shutil.copytree(versions[0][0], bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    status, _, body = call(server.url, "/weights/load", {"path": str(bad), "version": 2})
    assert status == 500 and "version 2" in body["error"]["message"]
    assert call(server.url, "/health")[2] == {"status": "ok", "version": 1}
    out = completion(server, prompt="9", max_tokens=10, temperature=0)
    assert (out["weights_version"], out["choices"][0]["token_ids"]) == (1, greedy(versions, 1, "9", 10))
    assert call(server.url, "/weights")[2]["loading"] is False


@pytest.mark.parametrize("path,body,param", [
    ("/weights/load", {"version": 1}, "path"),
    ("/weights/load", {"path": "/nonexistent/dir", "version": 1}, "path"),
    ("/weights/load", {"path": "{v0}", "version": -1}, "version"),
    ("/weights/load", {"path": "{v0}", "version": "3"}, "version"),
    ("/weights/load", {"path": "{v0}", "version": True}, "version"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2]}, "prompt"),
    ("/v1/completions", {"prompt": "1", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "1", "n": 65}, "n"),
    ("/v1/completions", {"prompt": "1", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "1", "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "1", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "1", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "1", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "1", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "1", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": "1", "max_token": 3}, "max_token"),
    ("/v1/completions", {"prompt": "1", "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "1", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
])
def test_bad_requests_are_400_naming_the_field(server, versions, path, body, param):
    server.load(versions[0][0], 0)
    body = {k: versions[0][0] if v == "{v0}" else v for k, v in body.items()}
    status, _, out = call(server.url, path, body)
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"


def test_not_json_and_wrong_model(server, versions):
    server.load(versions[0][0], 0)
    for raw in (b"{not json", b"[1, 2]"):
        for path in ("/v1/completions", "/weights/load"):
            status, _, out = call(server.url, path, raw=raw)
            assert status == 400 and out["error"]["message"], (path, raw)
    status, _, out = call(server.url, "/v1/completions", {"prompt": "1", "model": "gpt-4"})
    assert status == 404 and out["error"]["param"] == "model"
    assert completion(server, prompt="1", model="policy", max_tokens=1)["choices"]


def test_in_flight_request_finishes_on_its_snapshot_and_old_model_is_freed(server, versions, monkeypatch):
    server.load(versions[0][0], 0)
    entered, release, real = threading.Event(), threading.Event(), serve.generate

    def gated(*args):
        entered.set()
        assert release.wait(30)
        return real(*args)

    monkeypatch.setattr(serve, "generate", gated)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=completion(
        server, prompt="77-", max_tokens=10, temperature=0)))
    t.start()
    assert entered.wait(30)  # the request holds its snapshot of version 0
    old = weakref.ref(server.current.model)
    server.load(versions[1][0], 1)
    assert call(server.url, "/health")[2]["version"] == 1
    release.set()
    t.join(30)
    out = result["out"]
    assert out["weights_version"] == 0
    assert out["choices"][0]["token_ids"] == greedy(versions, 0, "77-", 10)
    wait_for(lambda: gc.collect() is not None and old() is None, what="old model freed")


def test_loads_are_serialized_and_reported_while_running(server, versions, monkeypatch):
    entered = {0: threading.Event(), 1: threading.Event()}
    gate, real = threading.Event(), serve.load_weights

    def gated(path, version, device):
        entered[version].set()
        assert gate.wait(30)
        return real(path, version, device)

    monkeypatch.setattr(serve, "load_weights", gated)
    first = threading.Thread(target=server.load, args=(versions[0][0], 0))
    first.start()
    assert entered[0].wait(30)
    assert call(server.url, "/weights")[2]["loading"] is True
    assert call(server.url, "/health")[0] == 503
    second = threading.Thread(target=server.load, args=(versions[1][0], 1))
    second.start()
    # A bounded negative check, not synchronisation: without the lock it enters at once.
    assert not entered[1].wait(0.5), "a second load ran while the first was loading"
    gate.set()
    first.join(30)
    second.join(30)
    assert entered[1].is_set() and server.current.version == 1 and not server.loading


def test_reload_under_concurrent_load_never_mixes_versions(server, versions):
    server.load(versions[0][0], 0)
    for v in (0, 1):  # warm the references outside the timed part
        for p in PROMPTS:
            greedy(versions, v, p, 8)
    results, errors, lock = [], [], threading.Lock()

    def client(k):
        try:
            seen_new, count = False, 0
            while not (seen_new and count >= 3) and count < 40:
                prompt = PROMPTS[(k + count) % len(PROMPTS)]
                status, headers, out = call(server.url, "/v1/completions",
                                            dict(prompt=prompt, n=2, max_tokens=8, temperature=0))
                with lock:
                    results.append((prompt, status, headers["X-RFT-Weights-Version"], out))
                seen_new, count = seen_new or out.get("weights_version") == 1, count + 1
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    wait_for(lambda: len(results) >= 6, what="first version-0 answers")
    status, _, body = call(server.url, "/weights/load", {"path": versions[1][0], "version": 1})
    assert status == 200, body
    for t in threads:
        t.join(60)
    assert not errors and len(results) >= 16
    for prompt, status, header, out in results:
        assert status == 200, out
        v = out["weights_version"]
        assert header == str(v)
        for c in out["choices"]:  # every sample equals that version's greedy output
            assert c["token_ids"] == greedy(versions, v, prompt, 8), (prompt, v)
    assert {out["weights_version"] for *_, out in results} == {0, 1}


def test_chat_completions(server, versions):
    server.load(versions[0][0], 0)
    messages = [{"role": "system", "content": "1+1"}, {"role": "user", "content": "2*3="}]
    status, headers, out = call(server.url, "/v1/chat/completions",
                                dict(messages=messages, max_tokens=6, temperature=0, n=2))
    assert status == 200 and headers["X-RFT-Weights-Version"] == "0"
    assert out["object"] == "chat.completion" and out["weights_version"] == 0
    # The tiny tokenizer has no chat template: the contents are joined by newlines.
    expect = greedy(versions, 0, "1+1\n2*3=", 6)
    assert out["prompt_token_ids"] == [versions[0][2]("1+1\n2*3=")["input_ids"]]
    for i, c in enumerate(out["choices"]):
        assert c["index"] == i and c["message"]["role"] == "assistant"
        assert c["token_ids"] == expect and c["finish_reason"] in ("stop", "length")
        assert c["message"]["content"] == versions[0][2].decode(expect, skip_special_tokens=True)


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """A tiny model whose tokenizer adds a BOS and whose chat template writes one."""
    from tests.trainer.test_prompts import save_bos_tokenizer

    path = save_tiny_model(tmp_path_factory.mktemp("bos") / "m", with_tokenizer=False)
    save_bos_tokenizer(path)
    return str(path), AutoTokenizer.from_pretrained(str(path))


def test_add_special_tokens_is_honoured_and_return_token_ids_accepted(server, bos_model):
    """Default true (a raw prompt gets the tokenizer's BOS); false for a prompt a chat
    template rendered (it has its BOS): one BOS either way. The explorer's opt-ins are
    accepted; the ids are returned regardless."""
    path, tok = bos_model
    server.load(path, 0)
    bos = tok.bos_token_id
    rendered = tok.apply_chat_template([{"role": "user", "content": "3+4"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == "<bos>?3+4="
    common = dict(max_tokens=2, temperature=0, return_token_ids=True, return_weight_versions=True)
    out = completion(server, prompt=rendered, add_special_tokens=False, **common)
    assert out["prompt_token_ids"] == [[bos] + tok("?3+4=", add_special_tokens=False)["input_ids"]]
    assert all(c["token_ids"] is not None for c in out["choices"])
    out = completion(server, prompt="3+4", **common)  # the default: true
    assert out["prompt_token_ids"] == [[bos] + tok("3+4", add_special_tokens=False)["input_ids"]]
    out = completion(server, prompt=rendered, add_special_tokens=True, **common)
    assert out["prompt_token_ids"][0].count(bos) == 2  # asked for: the double BOS

    # /v1/chat/completions: the template wrote the BOS, so none is added (as vLLM does).
    status, _, out = call(server.url, "/v1/chat/completions", dict(
        messages=[{"role": "user", "content": "3+4"}], max_tokens=2, temperature=0))
    assert status == 200 and out["prompt_token_ids"] == [tok(rendered, add_special_tokens=False)["input_ids"]]
    assert out["prompt_token_ids"][0].count(bos) == 1


def test_cli_defaults_come_from_the_pod_env(monkeypatch):
    monkeypatch.setenv("RFT_POD_IP", "10.1.2.3")
    monkeypatch.setenv("RFT_INFERENCE_PORT", "9123")
    args = serve.build_parser().parse_args([])
    assert (args.host, args.port, args.served_model_name, args.version) == ("10.1.2.3", 9123, "policy", 0)
    monkeypatch.delenv("RFT_POD_IP")
    monkeypatch.delenv("RFT_INFERENCE_PORT")
    args = serve.build_parser().parse_args([])
    assert (args.host, args.port, args.max_concurrency) == ("0.0.0.0", 8000, 4)


def test_cli_serves_model_dir_and_exits_0_on_sigterm(versions):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rft_serving.serve", "--host", "127.0.0.1",
                             "--port", str(port), "--model-dir", versions[0][0], "--version", "3"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert proc.poll() is None, proc.stdout.read()
        try:
            return call(url, "/health")[0] == 200
        except OSError:
            return False
    try:
        wait_for(healthy, timeout=90, what="the CLI server to become healthy")
        out = call(url, "/v1/completions", {"prompt": "1+2=", "max_tokens": 4, "temperature": 0})[2]
        assert out["weights_version"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        logs = proc.stdout.read()
        assert '"event": "weights_loaded"' in logs and '"event": "listening"' in logs
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("files, limit", [
    ({"cpu.max": "200000 100000\n"}, 2.0),  # cgroup v2: 2 CPUs
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_the_cpu_limit_is_read_from_either_cgroup_version(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert serve.cpu_limit(str(tmp_path)) == limit


def test_torch_threads_stay_within_the_containers_cpu_limit():
    """Sized for the node, 8 engines with 2 threads each on 2 cores took 1.8 s per reload in
    bench/weightsync.py, against 0.3 s with one each (docs/performance.md)."""
    assert serve.compute_threads(0, 1.5, 64) == 2
    assert serve.compute_threads(0, 0.5, 64) == 1
    assert serve.compute_threads(0, 16, 4) == 4  # never more than torch would take
    assert serve.compute_threads(0, None, 8) == 8
    assert serve.compute_threads(3, 1, 8) == 3  # --threads wins
