"""Experiences: validation, batching ops, the shard format and the buffer reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rft_trainer.experience import (
    FORMAT,
    BufferReader,
    Experiences,
    read_shard,
    write_shard,
)
from rft_contract.storage import LocalStorage


def make(n: int, T: int = 6, start: int = 0, version: int | None = 0, extras: bool = False) -> Experiences:
    """n samples; sample i has id start+i in tokens[:, 0], rewards and info."""
    ids = torch.arange(start, start + n)
    tokens = torch.zeros(n, T, dtype=torch.long)
    tokens[:, 0] = ids
    tokens[:, 1:4] = 7
    attention = torch.zeros(n, T, dtype=torch.bool)
    attention[:, :4] = True
    action = torch.zeros(n, T, dtype=torch.bool)
    action[:, 2:4] = True
    exp = Experiences(
        tokens=tokens, attention_mask=attention, action_mask=action,
        prompt_lengths=torch.full((n,), 2), rewards=ids.float(), group_ids=ids // 2,
        weights_version=None if version is None else torch.full((n,), version),
        info=[{"id": int(i)} for i in ids],
    )
    if extras:
        exp.rollout_logprobs = -torch.rand(n, T)
        exp.advantages = torch.randn(n, T)
    return exp


def ids(exp: Experiences) -> list[int]:
    return exp.tokens[:, 0].tolist()


# ------------------------------------------------------------------ the batch


def test_select_split_concat_to():
    exp = make(5, extras=True).validate()
    assert len(exp) == 5
    sel = exp.select([4, 0])
    assert ids(sel) == [4, 0] and [i["id"] for i in sel.info] == [4, 0]
    assert torch.equal(sel.advantages, exp.advantages[[4, 0]])
    parts = exp.split(2)
    assert [len(p) for p in parts] == [2, 2, 1] and ids(parts[2]) == [4]
    back = Experiences.concat(parts).validate()
    for name, t in exp.tensors().items():
        assert torch.equal(getattr(back, name), t), name
    assert exp.to("cpu").info == exp.info


def test_concat_pads_to_longest():
    a, b = make(2, T=4), make(1, T=6, start=2)
    both = Experiences.concat([a, b]).validate()
    assert both.tokens.shape == (3, 6)
    assert not both.attention_mask[:2, 4:].any() and not both.action_mask[:2, 4:].any()
    with pytest.raises(ValueError, match="optional fields differ"):
        Experiences.concat([make(1), make(1, version=None)])


def test_default_info_is_one_dict_per_sample():
    exp = make(3)
    exp = Experiences(**exp.tensors())
    assert exp.info == [{}, {}, {}]


@pytest.mark.parametrize("mutate, message", [
    (lambda e: setattr(e, "rewards", torch.zeros(4)), r"rewards: expected shape \(3,\) \(tokens is \(3, 6\)\), got \(4,\)"),
    (lambda e: setattr(e, "action_mask", e.action_mask[:, :5]), r"action_mask: expected shape \(3, 6\)"),
    (lambda e: setattr(e, "tokens", e.tokens.int()), "tokens: expected dtype int64, got torch.int32"),
    (lambda e: setattr(e, "action_mask", e.action_mask.long()), "action_mask: expected dtype bool"),
    (lambda e: setattr(e, "rewards", e.rewards.long()), "rewards: expected dtype float"),
    (lambda e: e.action_mask.__setitem__((1, 5), True), r"action_mask: True outside attention_mask in samples \[1\]"),
    (lambda e: e.action_mask.__setitem__((2, 0), True), r"action_mask: True inside the prompt in samples \[2\]"),
    (lambda e: e.rewards.__setitem__(0, float("nan")), r"rewards: not finite in samples \[0\]"),
    (lambda e: e.prompt_lengths.__setitem__(0, 9), "prompt_lengths: values must lie in"),
    (lambda e: e.info.pop(), "info: expected 3 entries, got 2"),
    (lambda e: setattr(e, "tokens", e.tokens[0]), "tokens: expected shape"),
])
def test_validate_names_field_and_shapes(mutate, message):
    exp = make(3)
    mutate(exp)
    with pytest.raises(ValueError, match=message):
        exp.validate()


def test_attention_mask_may_be_long():
    exp = make(2)
    exp.attention_mask = exp.attention_mask.long()
    exp.validate()


# ------------------------------------------------------------------ shards


def test_shard_round_trip(tmp_path):
    exp = make(4, extras=True, version=3)
    uri = write_shard(str(tmp_path), "shard-000", exp)
    assert uri == f"{tmp_path}/shard-000.json"
    meta = json.loads(Path(uri).read_text())
    assert meta["format"] == FORMAT and meta["num_samples"] == 4
    assert meta["fields"]["tokens"] == {"dtype": "int64", "shape": [4, 6]}
    assert "returns" not in meta["fields"]  # only present optional fields are stored
    assert (meta["weights_version_min"], meta["weights_version_max"]) == (3, 3)
    assert meta["info"] == exp.info and meta["created"].endswith("Z")
    for path in (uri, f"{tmp_path}/shard-000.safetensors", f"{tmp_path}/shard-000"):
        back = read_shard(path)
        assert back.returns is None and back.info == exp.info
        for name, t in exp.tensors().items():
            assert torch.equal(getattr(back, name), t) and getattr(back, name).dtype == t.dtype


def test_round_trip_via_file_uri(tmp_path):
    write_shard(f"file://{tmp_path}", "a", make(2))
    assert ids(read_shard(f"file://{tmp_path}/a.json")) == [0, 1]


def test_write_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="shard name"):
        write_shard(str(tmp_path), "../escape", make(1))
    bad = make(2)
    bad.rewards[0] = float("inf")
    with pytest.raises(ValueError, match="rewards"):
        write_shard(str(tmp_path), "x", bad)
    assert list(tmp_path.iterdir()) == []


def test_corrupt_safetensors_is_a_clear_error(tmp_path):
    write_shard(str(tmp_path), "s", make(2))
    (tmp_path / "s.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=r"s\.safetensors: size or sha256 differs"):
        read_shard(str(tmp_path / "s.json"))
    # Without a checksum to compare, the safetensors parser reports it.
    meta = json.loads((tmp_path / "s.json").read_text())
    meta["tensors"] = {"file": "s.safetensors"}
    (tmp_path / "s.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"s\.safetensors: not a valid safetensors file"):
        read_shard(str(tmp_path / "s.json"))


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m.update(format="other/v9"), "format is 'other/v9'"),
    (lambda m: m.update(num_samples=0), "num_samples must be a positive integer"),
    (lambda m: m.update(info=[]), "info must be a list of num_samples=2"),
    (lambda m: m["fields"].pop("rewards"), r"holds .* lists"),
])
def test_malformed_metadata(tmp_path, mutate, message):
    write_shard(str(tmp_path), "s", make(2))
    meta = json.loads((tmp_path / "s.json").read_text())
    mutate(meta)
    (tmp_path / "s.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"s.json: {message}|s.safetensors: {message}"):
        read_shard(str(tmp_path / "s.json"))


def test_metadata_not_json(tmp_path):
    write_shard(str(tmp_path), "s", make(2))
    (tmp_path / "s.json").write_text("{")
    with pytest.raises(ValueError, match="s.json: not valid JSON"):
        read_shard(str(tmp_path / "s.json"))


# ------------------------------------------------------------------ the reader


def fill(directory: Path, sizes: list[int], versions: list[int] | None = None) -> None:
    start = 0
    for i, n in enumerate(sizes):
        write_shard(str(directory), f"shard-{i:03d}", make(n, start=start, version=(versions or [0] * len(sizes))[i]))
        start += n


def test_reader_batches_in_order_across_shards(tmp_path):
    fill(tmp_path, [3, 2, 4])
    reader = BufferReader(str(tmp_path), batch_size=4)
    assert [ids(b) for b in reader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert reader.next_batch() is None  # one sample left: not a full batch
    assert reader.stats["batches"] == 2 and reader.stats["samples"] == 8


def test_shard_without_json_is_ignored(tmp_path):
    fill(tmp_path, [2])
    write_shard(str(tmp_path), "shard-001", make(2, start=2))
    (tmp_path / "shard-001.json").unlink()  # crashed between the two writes
    reader = BufferReader(f"file://{tmp_path}", batch_size=2)
    assert ids(reader.next_batch()) == [0, 1]
    assert reader.next_batch() is None


def test_resume_continues_exactly(tmp_path):
    fill(tmp_path, [3, 3, 3, 3])
    full = [ids(b) for b in BufferReader(str(tmp_path), batch_size=5)]
    reader = BufferReader(str(tmp_path), batch_size=5)
    first = ids(reader.next_batch())
    state = json.loads(json.dumps(reader.state_dict()))  # must survive serialisation
    assert state["streams"] == {"": {"shard": "shard-001", "offset": 2}} and state["consumed"] == {"": 5}
    resumed = BufferReader(str(tmp_path), batch_size=5)
    resumed.load_state_dict(state)
    assert [first] + [ids(b) for b in resumed] == full == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert resumed.stats["batches"] == 2


def test_incomplete_batch_consumes_nothing_and_new_shards_are_picked_up(tmp_path):
    fill(tmp_path, [3])
    reader = BufferReader(str(tmp_path), batch_size=4)
    assert reader.next_batch() is None and reader.state_dict()["streams"] == {}
    write_shard(str(tmp_path), "shard-001", make(3, start=3))
    assert ids(reader.next_batch()) == [0, 1, 2, 3]
    assert reader.next_batch(wait=True, timeout=0.05) is None


def test_staleness_filter(tmp_path):
    fill(tmp_path, [2, 2, 2], versions=[1, 4, 5])
    reader = BufferReader(str(tmp_path), batch_size=3, max_staleness=1)
    # current version 5: keep versions >= 4; shard-000 (v1) is skipped unread.
    assert ids(reader.next_batch(current_version=5)) == [2, 3, 4]
    assert reader.stats["dropped_stale"] == 2
    # Without a current version nothing is filtered.
    assert ids(BufferReader(str(tmp_path), batch_size=6).next_batch()) == list(range(6))


def test_staleness_within_a_shard(tmp_path):
    exp = make(4)
    exp.weights_version = torch.tensor([3, 0, 3, 0])
    write_shard(str(tmp_path), "s", exp)
    reader = BufferReader(str(tmp_path), batch_size=2, max_staleness=0)
    assert ids(reader.next_batch(current_version=3)) == [0, 2]
    assert reader.stats["dropped_stale"] == 1  # sample 3 is not looked at yet
    assert reader.state_dict()["streams"][""]["offset"] == 3


def test_dropped_samples_are_counted_by_version_lag(tmp_path):
    """take_dropped: the lags of what the committed batches passed over, exact whether a
    shard was read or skipped unread (its weights_versions), and nothing for a batch that
    did not complete (those samples are dropped, and counted, when one does)."""
    mixed = make(4, start=4)
    mixed.weights_version = torch.tensor([1, 2, 6, 2])
    write_shard(str(tmp_path), "shard-000", make(2, version=0))  # skipped unread
    write_shard(str(tmp_path), "shard-001", mixed)  # read: 1 and 2 are stale
    write_shard(str(tmp_path), "shard-002", make(1, start=8, version=6))
    meta = json.loads((tmp_path / "shard-001.json").read_text())
    assert meta["weights_versions"] == {"1": 1, "2": 2, "6": 1}
    reader = BufferReader(str(tmp_path), batch_size=3, max_staleness=1)
    assert reader.next_batch(current_version=6) is None  # 2 fresh samples only
    assert reader.take_dropped() == {}
    write_shard(str(tmp_path), "shard-003", make(1, start=9, version=5))
    assert ids(reader.next_batch(current_version=6)) == [6, 8, 9]
    assert reader.take_dropped() == {6: 2, 5: 1, 4: 2} and reader.take_dropped() == {}
    assert reader.stats["dropped_stale"] == 5


def test_shards_without_version_counts_or_entered_part_way_count_each_sample_s_lag(tmp_path):
    """A shard written before weights_versions existed: one version in all is skipped
    unread; mixed versions are read. A shard half read at an older version: the rest is
    read again and counted per sample, not at the shard's newest version."""
    for name, versions in (("shard-000", [2, 2, 2]), ("shard-001", [1, 2, 3])):
        exp = make(3, start=int(name[-1]) * 3)
        exp.weights_version = torch.tensor(versions)
        write_shard(str(tmp_path), name, exp)
        meta = json.loads((tmp_path / f"{name}.json").read_text())
        del meta["weights_versions"]
        (tmp_path / f"{name}.json").write_text(json.dumps(meta))
    write_shard(str(tmp_path), "shard-002", make(1, start=6, version=9))
    reader = BufferReader(str(tmp_path), batch_size=1, max_staleness=0)
    assert ids(reader.next_batch(current_version=9)) == [6]
    assert reader.take_dropped() == {7: 4, 8: 1, 6: 1}

    mixed = make(4, start=10)
    mixed.weights_version = torch.tensor([3, 3, 2, 1])
    write_shard(str(tmp_path / "b"), "shard-000", mixed)
    write_shard(str(tmp_path / "b"), "shard-001", make(1, start=20, version=6))
    reader = BufferReader(str(tmp_path / "b"), batch_size=2, max_staleness=0)
    assert ids(reader.next_batch(current_version=3)) == [10, 11]
    reader.batch_size = 1
    assert ids(reader.next_batch(current_version=6)) == [20]
    assert reader.take_dropped() == {4: 1, 5: 1}


def test_without_max_staleness_nothing_is_dropped(tmp_path):
    """staleSamples keep: the trainer reads with max_staleness None."""
    fill(tmp_path, [2, 2], versions=[0, 9])
    reader = BufferReader(str(tmp_path), batch_size=4, max_staleness=None)
    assert ids(reader.next_batch(current_version=9)) == [0, 1, 2, 3]
    assert reader.take_dropped() == {} and reader.stats["dropped_stale"] == 0


def test_reader_wait_polls_until_data_arrives(tmp_path, monkeypatch):
    reader = BufferReader(str(tmp_path), batch_size=2, poll_interval=0.01)
    calls = []

    def fake_sleep(seconds: float) -> None:  # the explorer commits while we wait
        calls.append(seconds)
        if len(calls) == 2:
            write_shard(str(tmp_path), "late", make(2))

    monkeypatch.setattr("rft_trainer.experience.time.sleep", fake_sleep)
    assert ids(reader.next_batch(wait=True, timeout=10)) == [0, 1]
    assert calls == [0.01, 0.01]


def test_reader_reports_corrupt_shard(tmp_path):
    fill(tmp_path, [2])
    (tmp_path / "shard-000.safetensors").write_bytes(b"nope")
    with pytest.raises(ValueError, match="shard-000.safetensors"):
        BufferReader(str(tmp_path), batch_size=2).next_batch()


def test_local_storage_list_is_prefix_match(tmp_path):
    s = LocalStorage()
    s.write_bytes(f"{tmp_path}/buf/a-1", b"1")
    s.write_bytes(f"{tmp_path}/buf/sub/a-2", b"2")
    s.write_bytes(f"{tmp_path}/buffer/b", b"3")
    assert s.list(f"{tmp_path}/buf/") == [f"{tmp_path}/buf/a-1", f"{tmp_path}/buf/sub/a-2"]
    assert len(s.list(f"{tmp_path}/buf")) == 3
    assert s.list(f"file://{tmp_path}/buf/a") == [f"file://{tmp_path}/buf/a-1"]
    assert s.read_bytes(f"{tmp_path}/buf/a-1") == b"1" and s.exists(f"{tmp_path}/buffer/b")
    s.delete(f"{tmp_path}/buffer/b")
    s.delete(f"{tmp_path}/buffer/b")  # missing is fine, as on S3
    assert not s.exists(f"{tmp_path}/buffer/b") and s.list(f"{tmp_path}/nothing/") == []


# ------------------------------------------------------------------ several writers


def test_a_slow_writers_shard_committed_late_is_still_read(tmp_path):
    """Explorer e001 commits seq 0 after e000 committed seq 0 and 1 and the reader went
    past them: a single name-order position skipped it forever (samples lost)."""
    d = str(tmp_path)
    write_shard(d, "0000000000-e000", make(2, start=0))
    write_shard(d, "0000000001-e000", make(2, start=2))
    reader = BufferReader(d, batch_size=4)
    assert ids(reader.next_batch()) == [0, 1, 2, 3]
    write_shard(d, "0000000000-e001", make(2, start=100))  # late
    write_shard(d, "0000000002-e000", make(2, start=4))
    assert ids(reader.next_batch()) == [100, 101, 4, 5]
    assert reader.consumed == {"e000": 6, "e001": 2}
    assert reader.next_batch() is None


def test_streams_merge_in_name_order_and_resume_exactly(tmp_path):
    d = str(tmp_path)
    for seq in range(3):
        for e in range(2):
            write_shard(d, f"{seq:010d}-e{e:03d}", make(3, start=100 * e + 3 * seq))
    full = [ids(b) for b in BufferReader(d, batch_size=4)]
    assert sum(full, []) == [0, 1, 2, 100, 101, 102, 3, 4, 5, 103, 104, 105, 6, 7, 8, 106, 107, 108][:16]
    reader = BufferReader(d, batch_size=4)
    first = [ids(reader.next_batch()) for _ in range(2)]
    state = json.loads(json.dumps(reader.state_dict()))
    assert state["streams"] == {"e000": {"shard": "0000000001-e000", "offset": 2},
                                "e001": {"shard": "0000000000-e001", "offset": 3}}
    resumed = BufferReader(d, batch_size=4)
    resumed.load_state_dict(state)
    assert first + [ids(b) for b in resumed] == full


def test_a_single_position_state_still_resumes(tmp_path):
    fill(tmp_path, [3, 3, 3])
    resumed = BufferReader(str(tmp_path), batch_size=2)
    resumed.load_state_dict({"shard": "shard-001", "offset": 1, "stats": {"batches": 2}})
    assert [ids(b) for b in resumed][:1] == [[4, 5]]
    assert resumed.consumed == {"": 3 + 1 + 2 + 2}  # what the old position had consumed, then two


def test_a_single_position_state_counts_what_each_explorer_had_consumed(tmp_path):
    """Explorers throttle on the consumed count: starting it at 0 after an upgrade would
    make every explorer wait for samples the trainer had long consumed (a deadlock)."""
    d = str(tmp_path)
    for seq in range(3):
        for e in range(2):
            write_shard(d, f"{seq:010d}-e{e:03d}", make(3, start=100 * e + 3 * seq))
    reader = BufferReader(d, batch_size=2)
    reader.load_state_dict({"shard": "0000000001-e000", "offset": 2})
    assert ids(reader.next_batch()) == [5, 103]
    assert reader.consumed == {"e000": 3 + 2 + 1, "e001": 3 + 1}


def test_stale_samples_an_incomplete_batch_passes_count_as_consumed_for_writers(tmp_path):
    """The explorers throttle on what the trainer is done with: stale samples it cannot
    use must release their budget even while no full batch of fresh ones exists."""
    d = str(tmp_path)
    write_shard(d, "0000000000-e000", make(4, start=0, version=0))
    write_shard(d, "0000000001-e000", make(2, start=4, version=5))
    reader = BufferReader(d, batch_size=4, max_staleness=1)
    assert reader.next_batch(current_version=5) is None
    assert reader.consumed == {} and reader.consumed_counts() == {"e000": 4}
    write_shard(d, "0000000002-e000", make(2, start=6, version=5))
    assert ids(reader.next_batch(current_version=5)) == [4, 5, 6, 7]
    assert reader.consumed_counts() == reader.consumed == {"e000": 8}
    assert reader.stats["dropped_stale"] == 4
