"""rft_contract.nccl without vLLM: the chunk plan's edges, the headers it reads and the
bodies it refuses to make. Against vLLM's own classes and packing:
tests/trainer/test_nccl_protocol.py."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from rft_contract import nccl


@pytest.mark.parametrize("sizes, limit, plan", [
    ([], 10, []),
    ([4, 4, 4], 10, [[0, 1, 2]]),  # 12 > 10 only with the third: it stays in the chunk
    ([4, 6, 4], 10, [[0, 1, 2]]),  # exactly 10 is not past the limit
    ([11, 1], 10, [[0], [1]]),  # a tensor larger than a chunk is a chunk of its own
    ([5, 6, 3, 8], 10, [[0, 1], [2, 3]]),
])
def test_chunks_cut_where_the_running_total_first_passes_the_limit(sizes, limit, plan):
    assert nccl.chunk_plan(sizes, limit) == plan


def _safetensors(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_header_gives_names_dtypes_shapes_and_byte_ranges_in_file_order(tmp_path):
    _safetensors(tmp_path / "a.safetensors", {
        "__metadata__": {"format": "pt"},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        "a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
    }, bytes(12))
    got = nccl.version_tensors(tmp_path, ["a.safetensors", "config.json"])
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in got] == [("a", "bfloat16", (2,), 4), ("b", "float32", (2,), 8)]
    assert got[1].offset - got[0].offset == 4
    assert nccl.update_info(got) == {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2], [2]]}


@pytest.mark.parametrize("header, words", [
    ({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, "does not send"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "does not match its shape"),
])
def test_a_header_the_transport_cannot_send_is_refused_by_name(tmp_path, header, words):
    _safetensors(tmp_path / "m.safetensors", header, bytes(8))
    with pytest.raises(ValueError, match=words):
        nccl.read_header(tmp_path / "m.safetensors")
    (tmp_path / "short.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match="not a safetensors file"):
        nccl.read_header(tmp_path / "short.safetensors")


def test_init_info_is_the_unique_id_rendezvous_packed_with_rank_0_first():
    uid = bytes(range(128))
    info = nccl.init_info(uid, 3, 1 << 20)
    assert base64.b64decode(info["nccl_unique_id_b64"], validate=True) == uid
    assert (info["rank_offset"], info["world_size"], info["packed"], info["packed_buffer_size_bytes"]) == (1, 3, True, 1 << 20)
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.init_info(b"x" * 16, 3)
    for bad in (1, True, "2", nccl.MAX_WORLD + 1):
        with pytest.raises(ValueError, match="world_size"):
            nccl.check_world_size(bad)
