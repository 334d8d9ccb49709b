"""The explorer against real reference servers (in-process, tiny model) writing shards to
a real S3-compatible server: shard contents, resume after a kill, failover, throttling
to the trainer, trainer-side staleness, the task sets, the config and the CLI."""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

from rft_contract.spec import parse_spec
from rft_operator.builders import JobRef, build_trainer_config
from rft_contract.config import ConfigError, load_explorer_config
from rft_trainer.experience import BufferReader, Experiences, read_shard, write_shard
from rft_rollout.explorer import Explorer, KubeProgress, shard_name
from rft_rollout.rollouts import build_experiences, build_samples
from rft_serving.serve import ReferenceServer
from rft_contract.storage import get_storage, join
from rft_rollout.tasksets import arithmetic, load_taskset, write_taskset
from tests.fixtures.models import save_tiny_model

ROLLOUTS, BATCH = 4, 8  # -> 2 tasks (8 samples) per shard


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("policy") / "m", seed=0)


@pytest.fixture(scope="module")
def servers(model_dir):
    """Two inference replicas serving the same weights as versions 3 and 4."""
    out = []
    for version in (3, 4):
        server = ReferenceServer(host="127.0.0.1", port=0, served_model_name="policy",
                                 device="cpu", max_concurrency=2)
        server.start()
        server.load(str(model_dir), version)
        out.append(server)
    yield out
    for server in out:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def job_config(model_dir, buffer_uri: str, taskset_uri: str, **explorer) -> dict:
    """The RFTJob spec as the operator dumps it (snake_case), with keys the explorer ignores."""
    return {
        "model": {"path": str(model_dir), "tokenizer_path": None, "dtype": "fp32"},
        "algorithm": {"name": "grpo", "learning_rate": 1e-6},
        "trainer": {"batch_size": BATCH, "total_steps": 10, "image": "trainer:1", "nodes": 1},
        "checkpoint": {"uri": "s3://unused/run", "interval": 5},
        "buffer": {"uri": buffer_uri, "max_staleness": 1},
        "sync": {"interval": 1, "pinned_version": None},
        "inference": {"replicas": 2, "port": 8000, "engine": "reference"},
        "explorer": {"replicas": 1, "taskset_uri": taskset_uri, "rollouts_per_task": ROLLOUTS,
                     "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 6},
                     "reward": "math_accuracy_format", "image": None, **explorer},
        "job": {"name": "demo", "namespace": "ns", "uid": "u"},
    }


def make_explorer(model_dir, tokenizer, buffer_uri, endpoints, tasks=None, index=0, replicas=1,
                  progress=None, **explorer) -> Explorer:
    tasks = tasks if tasks is not None else arithmetic(16, seed=1)
    config = load_explorer_config(job_config(model_dir, buffer_uri, "unused.jsonl", **explorer))
    return Explorer(config, endpoints, index, replicas, progress=progress, tokenizer=tokenizer,
                    tasks=tasks)


def shard_names(uri: str) -> list[str]:
    prefix = uri.rstrip("/") + "/"
    return [u[len(prefix):-5] for u in get_storage(uri).list(prefix)
            if u.endswith(".json") and "/" not in u[len(prefix):]]


def epoch_order(num_tasks: int, epoch: int, index: int = 0, replicas: int = 1) -> list[int]:
    import random

    order = list(range(num_tasks))
    random.Random(epoch).shuffle(order)
    return order[index::replicas]


# ------------------------------------------------------------------ against real servers


def test_two_servers_write_shards_the_trainer_reads(bucket, servers, model_dir, tokenizer):
    buffer = f"s3://{bucket}/run/buffer"
    tasks = arithmetic(16, seed=1)
    explorer = make_explorer(model_dir, tokenizer, buffer, [s.url for s in servers], tasks)
    assert explorer.tasks_per_shard == BATCH // ROLLOUTS == 2
    assert explorer.run(max_shards=3) == 3
    assert shard_names(buffer) == [shard_name(i, 0) for i in range(3)] == [
        "0000000000-e000", "0000000001-e000", "0000000002-e000"]

    reader = BufferReader(buffer, batch_size=BATCH)
    batches = list(reader)
    assert len(batches) == 3 and reader.stats["samples"] == 24
    expected = [tasks[i]["id"] for i in epoch_order(16, 0)[:6]]
    seen = []
    for batch in batches:
        # Two tasks per shard, ROLLOUTS samples each, one group id per task.
        groups = batch.group_ids.tolist()
        assert [groups.count(g) for g in dict.fromkeys(groups)] == [ROLLOUTS, ROLLOUTS]
        assert set(batch.weights_version.tolist()) == {3, 4}  # one task per server
        for i, info in enumerate(batch.info):
            task = next(t for t in tasks if t["id"] == info["task_id"])
            assert info["explorer"] == 0 and info["epoch"] == 0 and info["prompt"] == task["prompt"]
            assert batch.group_ids[i] == tasks.index(task)  # epoch 0: the task index
            p = int(batch.prompt_lengths[i])
            assert tokenizer.decode(batch.tokens[i, :p]) == task["prompt"]
            assert info["reward"] == pytest.approx(float(batch.rewards[i]))
            response = batch.tokens[i][batch.action_mask[i]].tolist()
            if info["finish_reason"] == "stop":
                assert response[-1] == tokenizer.eos_token_id  # appended: learn to stop
            assert tokenizer.decode(response, skip_special_tokens=True) == info["response"]
            lp = batch.rollout_logprobs[i]
            assert (lp[~batch.action_mask[i]] == 0).all() and (lp <= 0).all()
            seen.append(info["task_id"])
    assert list(dict.fromkeys(seen)) == expected

    state = json.loads(get_storage(buffer).read_bytes(f"{buffer}/_explorer/e000.json"))
    assert (state["seq"], state["epoch"], state["position"], state["samples"]) == (3, 0, 6, 24)


def test_restart_resumes_and_skips_a_committed_shard(bucket, servers, model_dir, tokenizer):
    buffer = f"s3://{bucket}/run/buffer"
    urls = [s.url for s in servers]
    tasks = arithmetic(16, seed=1)
    assert make_explorer(model_dir, tokenizer, buffer, urls, tasks).run(max_shards=2) == 2

    # A crash after committing shard 2 but before saving the state: the shard exists.
    marker = Experiences(tokens=torch.tensor([[5, 6]]), attention_mask=torch.tensor([[True, True]]),
                         action_mask=torch.tensor([[False, True]]), prompt_lengths=torch.tensor([1]),
                         rewards=torch.tensor([0.0]), group_ids=torch.tensor([999]),
                         rollout_logprobs=torch.zeros(1, 2), weights_version=torch.tensor([4]),
                         info=[{"marker": True}])
    write_shard(buffer, shard_name(2, 0), marker)
    storage = get_storage(buffer)
    before = storage.read_bytes(f"{buffer}/{shard_name(2, 0)}.json")

    restarted = make_explorer(model_dir, tokenizer, buffer, urls, tasks)
    assert restarted.run(max_shards=1) == 1
    assert storage.read_bytes(f"{buffer}/{shard_name(2, 0)}.json") == before  # not rewritten
    assert shard_names(buffer) == [shard_name(i, 0) for i in range(4)]
    state = restarted.state
    assert (state.seq, state.epoch, state.position, state.samples) == (4, 0, 8, 8 + 8 + 1 + 8)
    # Shard 3 holds the tasks after the skipped shard's: positions 6 and 7 of epoch 0.
    order = epoch_order(16, 0)
    ids = dict.fromkeys(i["task_id"] for i in read_shard(f"{buffer}/{shard_name(3, 0)}").info)
    assert list(ids) == [tasks[order[6]]["id"], tasks[order[7]]["id"]]
    # ... and the first two shards' tasks are positions 0..3.
    first = [i["task_id"] for n in range(2) for i in read_shard(f"{buffer}/{shard_name(n, 0)}").info]
    assert list(dict.fromkeys(first)) == [tasks[order[p]]["id"] for p in range(4)]


def test_failover_to_the_live_endpoint(tmp_path, servers, model_dir, tokenizer):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    buffer = str(tmp_path / "buffer")
    explorer = make_explorer(model_dir, tokenizer, buffer, [dead, servers[1].url], tasks_per_shard=4)
    assert explorer.run(max_shards=1) == 1
    exp = read_shard(join(buffer, shard_name(0, 0)))
    assert len(exp) == 4 * ROLLOUTS and exp.weights_version.unique().tolist() == [4]
    assert explorer.client.failures >= 1


def test_throttle_waits_for_the_trainer(tmp_path, servers, model_dir, tokenizer):
    trainer = {"step": 0}
    explorer = make_explorer(model_dir, tokenizer, str(tmp_path / "buffer"), [servers[0].url],
                             progress=lambda: (trainer["step"], 10), poll_interval=0.02)
    done = threading.Thread(target=explorer.run, kwargs={"max_shards": 3}, daemon=True)
    done.start()
    # (step 0 + staleness 1 + 1) * batch 8 / 1 replica = 16 samples = 2 shards, then wait.
    assert explorer.waiting.wait(timeout=60)
    assert shard_names(str(tmp_path / "buffer")) == [shard_name(0, 0), shard_name(1, 0)]
    assert done.is_alive()
    trainer["step"] = 1  # the trainer consumed a batch: one more shard is allowed
    done.join(timeout=60)
    assert not done.is_alive()
    assert shard_names(str(tmp_path / "buffer")) == [shard_name(i, 0) for i in range(3)]

    trainer["step"] = 10  # the trainer finished: the explorer exits without writing
    assert explorer.run() == 0 and explorer.finished


def test_throttle_follows_what_the_trainer_consumed_and_stale_drops_release_it(tmp_path, servers, model_dir,
                                                                               tokenizer):
    """The deadlock of issue 12: the trainer dropped the explorer's samples as stale and
    waits for fresh ones at the same step; an explorer throttled on the step (or on what it
    wrote) waits for the trainer for ever. Throttled on what the trainer is done with
    (status.trainer.buffer.consumed, stale drops included), it writes on."""
    trainer = {"step": 5, "consumed": {"e000": 0}}
    explorer = make_explorer(model_dir, tokenizer, str(tmp_path / "buffer"), [servers[0].url],
                             progress=lambda: (trainer["step"], 10, dict(trainer["consumed"])),
                             poll_interval=0.02)
    done = threading.Thread(target=explorer.run, kwargs={"max_shards": 3}, daemon=True)
    done.start()
    # (staleness 1 + 1) * batch 8 / 1 replica = 16 unconsumed samples = 2 shards, then wait,
    # however far the step is.
    assert explorer.waiting.wait(timeout=60)
    assert shard_names(str(tmp_path / "buffer")) == [shard_name(0, 0), shard_name(1, 0)]
    assert done.is_alive()
    trainer["consumed"] = {"e000": 8}  # dropped as stale: the step did not move
    done.join(timeout=60)
    assert not done.is_alive()
    assert shard_names(str(tmp_path / "buffer")) == [shard_name(i, 0) for i in range(3)]


def test_a_trainer_short_of_a_batch_lets_a_live_explorer_fill_it(tmp_path, servers, model_dir, tokenizer):
    """Explorer 0 of 2 holds its share of 2 batches of 8 (8 samples) and the other explorer
    is down: the trainer waits for experiences. Told so, explorer 0 may hold all 16."""
    trainer = {"waiting": None}
    explorer = make_explorer(model_dir, tokenizer, str(tmp_path / "buffer"), [servers[0].url],
                             index=0, replicas=2, poll_interval=0.02,
                             progress=lambda: (0, 10, {"e000": 0}, trainer["waiting"]))
    done = threading.Thread(target=explorer.run, kwargs={"max_shards": 2}, daemon=True)
    done.start()
    assert explorer.waiting.wait(timeout=60)  # its share: (1 + 1) * 8 / 2 = 8 samples = 1 shard
    assert shard_names(str(tmp_path / "buffer")) == [shard_name(0, 0)]
    trainer["waiting"] = "WaitingForExperiences"
    done.join(timeout=60)
    assert not done.is_alive()
    assert shard_names(str(tmp_path / "buffer")) == [shard_name(0, 0), shard_name(1, 0)]


def test_stop_drops_the_partial_shard(tmp_path, servers, model_dir, tokenizer):
    explorer = make_explorer(model_dir, tokenizer, str(tmp_path / "buffer"), [servers[0].url])
    complete = explorer.client.complete

    def sigterm_mid_request(body):  # what the SIGTERM handler does, while a request is out
        explorer.stop()
        return complete(body)

    explorer.client.complete = sigterm_mid_request
    assert explorer.run() == 0
    assert shard_names(str(tmp_path / "buffer")) == []
    assert explorer.state.seq == 0 and explorer.load_state().position == 0


def test_rejected_requests_fail_loudly(tmp_path, servers, model_dir, tokenizer):
    # prompt + max_tokens beyond the tiny model's context: every request is a 400.
    explorer = make_explorer(model_dir, tokenizer, str(tmp_path / "buffer"), [servers[0].url],
                             sampling={"max_tokens": 1000})
    with pytest.raises(RuntimeError, match="rejected 8 tasks in a row"):
        explorer.run()
    assert explorer.client.failures == 0  # 4xx is not retried
    # Rejected tasks are skipped (8 tasks = 4 shards' worth), nothing is written.
    assert shard_names(str(tmp_path / "buffer")) == []
    assert (explorer.state.seq, explorer.state.position) == (0, 6)  # the 4th shard's tasks raised


def test_a_rejected_task_is_skipped(tmp_path, servers, model_dir, tokenizer):
    tasks = arithmetic(4)
    tasks[epoch_order(4, 0)[0]]["prompt"] = "1" * 300  # beyond the tiny model's context
    explorer = make_explorer(model_dir, tokenizer, str(tmp_path / "buffer"), [servers[0].url], tasks)
    assert explorer.run(max_shards=1) == 1
    exp = read_shard(join(str(tmp_path / "buffer"), shard_name(0, 0)))
    assert len(exp) == ROLLOUTS and exp.info[0]["task_id"] == tasks[epoch_order(4, 0)[1]]["id"]


@pytest.mark.parametrize("prompt_format", ["chat", None])
def test_chat_prompts_are_sent_and_stored_templated(tmp_path, servers, model_dir, prompt_format):
    """With a chat template (explicit chat, or unset) the server gets the rendered prompt and
    the shard's prompt tokens are exactly its tokens, special ones included."""
    from transformers import AutoTokenizer

    chat_tok = AutoTokenizer.from_pretrained(model_dir)  # not the shared fixture: it is changed
    chat_tok.chat_template = ("{{ bos_token }}{% for m in messages %}?{{ m['content'] }}{% endfor %}"
                              "{% if add_generation_prompt %}A{% endif %}")
    tasks = arithmetic(4, seed=2)
    buffer = str(tmp_path / "buffer")
    explorer = make_explorer(model_dir, chat_tok, buffer, [s.url for s in servers], tasks,
                             prompt_format=prompt_format)
    assert explorer.prompt_format == "chat"
    assert explorer.run(max_shards=1) == 1
    exp = read_shard(join(buffer, shard_name(0, 0)))
    assert len(exp) == BATCH
    for i, info in enumerate(exp.info):
        task = next(t for t in tasks if t["id"] == info["task_id"])
        templated = f"<bos>?{task['prompt']}A"
        assert chat_tok.apply_chat_template([{"role": "user", "content": task["prompt"]}], tokenize=False,
                                            add_generation_prompt=True) == templated
        p = int(exp.prompt_lengths[i])
        assert exp.tokens[i, :p].tolist() == chat_tok(templated)["input_ids"]
        assert exp.tokens[i, 0] == chat_tok.bos_token_id and p == len(task["prompt"]) + 3
        assert info["reward"] == pytest.approx(float(exp.rewards[i]))


def test_a_chat_template_bos_is_the_only_bos(tmp_path):
    """A Llama-3-style model: its tokenizer adds a BOS and its chat template writes one.
    The explorer asks the server not to add another, so the shard's prompts (the ids the
    server ran) start with exactly one BOS."""
    from transformers import AutoTokenizer

    from tests.trainer.test_prompts import save_bos_tokenizer

    model = save_tiny_model(tmp_path / "bos-model", seed=0, with_tokenizer=False)
    save_bos_tokenizer(model)
    tok = AutoTokenizer.from_pretrained(str(model))
    server = ReferenceServer(max_concurrency=2)
    server.start()
    try:
        server.load(str(model), 3)
        tasks = arithmetic(4, seed=2)
        buffer = str(tmp_path / "buffer")
        explorer = make_explorer(model, tok, buffer, [server.url], tasks)
        assert explorer.prompt_format == "chat" and explorer.run(max_shards=1) == 1
    finally:
        server.stop()
    exp = read_shard(join(buffer, shard_name(0, 0)))
    for i, info in enumerate(exp.info):
        task = next(t for t in tasks if t["id"] == info["task_id"])
        prompt = exp.tokens[i, :int(exp.prompt_lengths[i])].tolist()
        assert prompt == [tok.bos_token_id] + tok(f"?{task['prompt']}=", add_special_tokens=False)["input_ids"]
        assert prompt.count(tok.bos_token_id) == 1


def test_staleness_drops_old_versions(tmp_path, servers, model_dir, tokenizer):
    """Shard 0 from version 3 only, shard 1 from both servers, shard 2 from version 4 only:
    at trainer version 5 with max_staleness 1, the first batch is the 8 version-4 samples
    and the 12 version-3 ones before them are dropped."""
    buffer = str(tmp_path / "buffer")
    v3, v4 = (s.url for s in servers)
    for endpoints in ([v3], [v3, v4], [v4]):
        make_explorer(model_dir, tokenizer, buffer, endpoints).run(max_shards=1)
    versions = [read_shard(join(buffer, shard_name(i, 0))).weights_version.tolist() for i in range(3)]
    assert [sorted(v) for v in versions] == [[3] * 8, [3] * 4 + [4] * 4, [4] * 8]
    reader = BufferReader(buffer, batch_size=8, max_staleness=1)
    batch = reader.next_batch(current_version=5)  # keeps versions >= 4
    assert batch.weights_version.tolist() == [4] * 8
    assert reader.stats["dropped_stale"] == 12
    assert BufferReader(buffer, batch_size=8, max_staleness=2).next_batch(current_version=5) \
        .weights_version.tolist() == [3] * 8  # version 3 is within 2 of 5


# ------------------------------------------------------------------ pure pieces


def test_build_samples_and_experiences(tokenizer):
    response = {"weights_version": 7, "prompt_token_ids": [[6, 15, 7]], "choices": [
        {"index": 1, "text": "12", "finish_reason": "length", "token_ids": [5, 6],
         "logprobs": {"tokens": ["1", "2"], "token_logprobs": [-0.5, -0.25]}},
        {"index": 0, "text": "3", "finish_reason": "stop", "token_ids": [7],
         "logprobs": {"tokens": ["3"], "token_logprobs": [-1.0]}},
    ]}
    task = {"id": "t", "prompt": "2+3=", "answer": "3"}
    samples = build_samples(response, task, tokenizer, lambda p, r, a: float(r == a), 11, {"task_id": "t"})
    assert [s.response_ids for s in samples] == [[7, tokenizer.eos_token_id], [5, 6]]  # by index
    assert [s.reward for s in samples] == [1.0, 0.0]
    exp = build_experiences(samples)
    assert exp.tokens.tolist() == [[6, 15, 7, 7, 1], [6, 15, 7, 5, 6]]
    assert exp.action_mask.tolist() == [[False] * 3 + [True] * 2] * 2
    # The appended stop token's log-prob was not reported: NaN (unknown), not 0 (probability 1).
    assert exp.rollout_logprobs.nan_to_num(nan=9.0).tolist() == [[0, 0, 0, -1.0, 9.0], [0, 0, 0, -0.5, -0.25]]
    assert exp.group_ids.tolist() == [11, 11] and exp.weights_version.tolist() == [7, 7]
    assert exp.info[0] == {"task_id": "t", "reward": 1.0, "response": "3", "finish_reason": "stop"}

    # Without server token ids: tokenize; shorter samples are right-padded.
    bare = {"choices": [{"index": 0, "text": "7", "finish_reason": "length"}]}
    (s,) = build_samples(bare, task, tokenizer, lambda *a: 0.0, 0, header_version=2)
    assert s.prompt_ids == tokenizer("2+3=")["input_ids"] and s.weights_version == 2
    assert s.response_logprobs and all(math.isnan(x) for x in s.response_logprobs)  # not reported
    with pytest.raises(ValueError, match="weights_version"):
        build_samples(bare, task, tokenizer, lambda *a: 0.0, 0)


def test_config_from_the_operators_json():
    spec = parse_spec({
        "model": {"path": "s3://models/tiny"}, "algorithm": {"name": "grpo"},
        "trainer": {"image": "t:1", "totalSteps": 20, "batchSize": 32},
        "checkpoint": {"uri": "s3://ckpts/demo/"}, "inference": {"replicas": 2},
        "explorer": {"tasksetUri": "s3://data/arith.jsonl", "rolloutsPerTask": 8,
                     "sampling": {"maxTokens": 16}},
    })
    data = json.loads(json.dumps(build_trainer_config(JobRef("demo", "ns", "uid"), spec)))
    cfg = load_explorer_config(data)
    assert cfg.buffer.uri == "s3://ckpts/demo/buffer"
    assert cfg.buffer.max_staleness == 1 and cfg.trainer.total_steps == 20
    assert cfg.explorer.sampling.max_tokens == 16 and cfg.explorer.sampling.temperature == 1.0
    assert cfg.explorer.reward == "math_accuracy" and cfg.explorer.tasks_per_shard is None
    assert cfg.explorer.request_timeout == 300.0 and (cfg.job.name, cfg.job.namespace) == ("demo", "ns")

    bad = copy.deepcopy(data)
    bad["explorer"]["rollouts_per_tsk"] = 3
    with pytest.raises(ConfigError, match="explorer.rollouts_per_tsk: unknown key"):
        load_explorer_config(bad)
    bad = copy.deepcopy(data)
    bad["explorer"]["sampling"]["top_p"] = 0
    with pytest.raises(ConfigError, match="explorer.sampling.top_p: must be > 0"):
        load_explorer_config(bad)
    with pytest.raises(ConfigError, match="explorer: required section"):
        load_explorer_config({k: v for k, v in data.items() if k != "explorer"})


def test_kube_progress_reads_the_rftjob_status():
    class Api:
        status: dict | Exception = {}

        def get_namespaced_custom_object(self, group, version, ns, plural, name, **kwargs):
            assert (group, version, ns, plural, name) == ("rft.dev", "v1alpha1", "ns", "rftjobs", "demo")
            if isinstance(self.status, Exception):
                raise self.status
            return {"status": self.status}

    api = Api()
    progress = KubeProgress(api, "demo", "ns", total_steps=10)
    assert progress() == (0, 10, None, None)  # the trainer has not reported yet
    api.status = {"trainer": {"step": 3, "totalSteps": 12, "buffer": {"consumed": {"e000": 24}},
                              "waiting": {"reason": "WaitingForExperiences"}}}
    assert progress() == (3, 12, {"e000": 24}, "WaitingForExperiences")
    api.status = RuntimeError("apiserver down")
    assert progress() == (3, 12, {"e000": 24}, "WaitingForExperiences")  # the last known value


def test_tasksets_round_trip_through_s3_and_reject_bad_lines(bucket):
    tasks = arithmetic(50, seed=3, ops="+-*")
    assert len({t["id"] for t in tasks}) == 50 and tasks[0]["id"] == "arith-000000"
    assert set("".join(t["prompt"] + t["answer"] for t in tasks)) <= set("0123456789+-*= ?")
    assert all(str(eval(t["prompt"][:-1])) == t["answer"] for t in tasks)
    assert arithmetic(50, seed=3, ops="+-*") == tasks
    uri = f"s3://{bucket}/data/arith.jsonl"
    assert write_taskset(uri, tasks) == 50
    assert load_taskset(uri) == tasks

    storage = get_storage(uri)
    storage.write_bytes(uri, b'{"question": "1+1=", "answer": 2}\n\n{"prompt": "x", "answer": "y", "id": 5}\n')
    assert load_taskset(uri) == [{"id": "task-1", "prompt": "1+1=", "answer": "2"},
                                 {"id": "5", "prompt": "x", "answer": "y"}]
    for body, message in [(b'{"prompt": "1+1="}', "line 2: missing key 'answer'"),
                          (b'{"answer": "2"}', "line 2: missing key 'prompt' (or 'question')"),
                          (b"{nope", "line 2: not valid JSON"),
                          (b"[1]", "line 2: expected a JSON object")]:
        storage.write_bytes(uri, b'{"prompt": "a", "answer": "b"}\n' + body)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_taskset(uri)


def test_cli_writes_a_shard(bucket, servers, model_dir, tmp_path):
    write_taskset(f"s3://{bucket}/tasks.jsonl", arithmetic(8))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(job_config(model_dir, "", f"s3://{bucket}/tasks.jsonl",
                                            replicas=2) | {"checkpoint": {"uri": f"s3://{bucket}/run"}}
                                 | {"buffer": {"max_staleness": 1}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RFT_") and k != "KUBECONFIG"}
    env["RFT_EXPLORER_INDEX"] = "1"  # replicas from the config: 2
    res = subprocess.run([sys.executable, "-m", "rft_rollout.explorer", "--config", str(config),
                          "--endpoints", servers[1].url, "--max-shards", "1"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    buffer = f"s3://{bucket}/run/buffer"
    assert shard_names(buffer) == [shard_name(0, 1)]
    exp = read_shard(f"{buffer}/{shard_name(0, 1)}")
    assert len(exp) == BATCH and {i["explorer"] for i in exp.info} == {1}
    assert '"event": "shard"' in res.stderr


def test_cli_exits_0_on_sigterm(bucket, servers, model_dir, tmp_path):
    """Without a trainer to follow it explores until SIGTERM, then stops cleanly."""
    import signal

    write_taskset(f"s3://{bucket}/tasks.jsonl", arithmetic(8))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(job_config(model_dir, f"s3://{bucket}/buf", f"s3://{bucket}/tasks.jsonl")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RFT_") and k != "KUBECONFIG"}
    env["RFT_INFERENCE_ENDPOINTS"] = f"{servers[0].url},{servers[1].url}"
    proc = subprocess.Popen([sys.executable, "-m", "rft_rollout.explorer", "--config", str(config)],
                            env=env, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        for line in proc.stderr:  # wait for the first committed shard
            if '"event": "shard"' in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait() == 0, rest[-3000:]
    finally:
        watchdog.cancel()
    assert '"event": "explorer_exit"' in rest
    state = json.loads(get_storage(f"s3://{bucket}/buf").read_bytes(f"s3://{bucket}/buf/_explorer/e000.json"))
    assert shard_names(f"s3://{bucket}/buf") == [shard_name(i, 0) for i in range(state["seq"])]


def test_cli_logs_its_rollouts_to_the_jobs_trackers_in_runs_of_its_own(bucket, servers, model_dir, tmp_path):
    """spec.tracking reaches the explorer too (as Trinity-RFT, one run per role): explorer 1
    of 2 logs each shard's rollout figures to a real MLflow server, in the run
    `demo_explorer-1` (not the trainer's `demo`), and to the TensorBoard run `explorer-1`
    beside the trainer's on S3, read back with TensorBoard's own reader. A second process
    (a restarted pod) continues the same MLflow run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from e2e.mlflow_server import MLflowServer

    write_taskset(f"s3://{bucket}/tasks.jsonl", arithmetic(8))
    root = f"s3://{bucket}/run"
    cfg = job_config(model_dir, "", f"s3://{bucket}/tasks.jsonl", replicas=2) | {
        "checkpoint": {"uri": root}, "buffer": {"max_staleness": 1}}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RFT_", "MLFLOW_")) and k != "KUBECONFIG"}
    env["RFT_EXPLORER_INDEX"] = "1"
    with MLflowServer(tmp_path / "mlflow") as server:
        cfg["tracking"] = {"mlflow": {"tracking_uri": server.url, "experiment": "explore"}, "tensorboard": {}}
        config = tmp_path / "config.json"
        config.write_text(json.dumps(cfg))
        for shards in (2, 1):  # the second process resumes after shard 2 and writes one more
            res = subprocess.run([sys.executable, "-m", "rft_rollout.explorer", "--config", str(config),
                                  "--endpoints", servers[1].url, "--max-shards", str(shards)],
                                 env=env, capture_output=True, text=True, timeout=180)
            assert res.returncode == 0, res.stderr[-3000:]
        (run,) = server.runs("explore")
        assert run["info"]["run_name"] == "demo_explorer-1"
        tags = {t["key"]: t["value"] for t in run["data"].get("tags") or []}
        assert tags["rft.role"] == "explorer-1" and tags["rft.job"] == "demo"
        rewards = server.history(run["info"]["run_id"], "rollout/rewards/mean")
        assert sorted(m["step"] for m in rewards) == [1, 2, 3]
        assert all(0.0 <= m["value"] <= 1.0 for m in rewards)
        samples = server.history(run["info"]["run_id"], "rollout/samples")
        assert {m["value"] for m in samples} == {BATCH}
    storage, local = get_storage(root), tmp_path / "tb"
    for uri in storage.list(f"{root}/tensorboard/explorer-1/"):
        (local / uri.rsplit("/", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
        (local / uri.rsplit("/", 1)[1]).write_bytes(storage.read_bytes(uri))
    acc = EventAccumulator(str(local))
    acc.Reload()
    assert [e.step for e in acc.Scalars("rollout/rewards/mean")] == [1, 2, 3]
    assert {"rollout/response_length/mean", "rollout/policy_version/min", "timing_s/shard"} <= set(
        acc.Tags()["scalars"])


def test_trainer_done_reads_the_trainers_progress_once(tmp_path, model_dir, tokenizer):
    """Stopped by the operator after the job succeeded, the explorer asks once more whether
    the trainer finished, so its tracker runs end FINISHED rather than KILLED."""
    def explorer(progress):
        return make_explorer(model_dir, tokenizer, str(tmp_path / "buf"), ["http://127.0.0.1:9"], progress=progress)

    def down():
        raise OSError("API server unreachable")

    assert explorer(lambda: (10, 10, None, None)).trainer_done()
    assert not explorer(lambda: (3, 10, None, None)).trainer_done()
    assert not explorer(lambda: None).trainer_done()  # no job status yet
    assert not explorer(down).trainer_done()
    assert not explorer(None).trainer_done()  # no trainer to follow (the CLI without a job)
