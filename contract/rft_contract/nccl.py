"""vLLM's NCCL weight transfer, as trainer rank 0 and the sync agents speak it
(`spec.sync.transport: nccl`). Torch-free: the wire format and the request bodies only.

vLLM 0.32.0 started with `--weight-transfer-config {"backend": "nccl"}` (its profile's
`nccl_flags`, rft_contract.engines; and VLLM_SERVER_DEV_MODE=1) takes new weights over an NCCL communicator from a process that
does not import vLLM: that process is rank 0 and makes the communicator's unique id; the
engine's workers join it at ranks `rank_offset` (1) onwards when told so over HTTP:

    POST /init_weight_transfer_engine {"init_info": init_info(...)}     blocks until the
        communicator is up: rank 0 joins it (ncclCommInitRank) at the same time, then
        every rank runs one float32 all-reduce of one element (the workers' warm-up)
    POST /start_weight_update                                           the model's layers
        wait for new values (layerwise reload)
    POST /update_weights {"update_info": update_info(tensors)}          blocks until every
        byte arrived: rank 0 broadcasts them meanwhile, packed (`chunk_plan`)
    POST /finish_weight_update

(vllm/entrypoints/rl/online/api_router.py, vllm/distributed/weight_transfer/nccl_common.py,
nccl_engine.py and packed_tensor.py of 0.32.0.) The tensors go under their names in the
export (Hugging Face's): the model's `load_weights` maps them onto vLLM's fused
parameters as it does for files. A tied output layer is not in the export, so it is not
sent either (vLLM refuses `lm_head.weight` without `embed_tokens` in the same call).

What arrives is checked as a reload from files is: the export's fingerprint, in the engine,
before the engine serves (rft_serving.engines.VLLMEngine.receive).

Packed: the tensors' bytes, in the order `update_info` names them, are cut into chunks;
a chunk takes tensors until its size first exceeds `packed_buffer_size_bytes` (the tensor
that crosses it stays in that chunk), and each chunk is one uint8 broadcast. Both ends
compute the same cuts from the same list, so the size must match exactly
(tests/trainer/test_nccl_protocol.py checks this plan against vLLM's own packing).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

TRANSPORTS = ("files", "nccl")  # spec.sync.transport
UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
RANK_OFFSET = 1  # rank 0 is the trainer's; the engine's workers follow
# Bytes per packed broadcast. vLLM's default is 1 GiB; rank 0 trains on the same GPU, so a
# quarter of it (one chunk in GPU memory at a time on rank 0).
BUFFER_BYTES = 256 << 20
NUM_BUFFERS = 2  # the workers' buffers in flight (their streams only: not on the wire)
MAX_WORLD = 1025  # rank 0 and at most 1,024 workers of one engine

# safetensors' dtype names -> torch's (what `dtype_names` carries: getattr(torch, name)).
SAFETENSORS_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
              "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


class TensorMeta(NamedTuple):
    name: str
    dtype: str  # torch's name
    shape: tuple[int, ...]
    file: str  # the safetensors file in the version directory
    offset: int  # of its bytes in that file, from the file's start
    nbytes: int


def read_header(path: str | Path) -> list[TensorMeta]:
    """The tensors of one safetensors file, in the order of their bytes in it."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path.name}: not a safetensors file (shorter than its header's size)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ValueError(f"{path.name}: a header of {size} bytes is not a safetensors header")
        header = json.loads(f.read(size))
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path.name}: {name} has dtype {entry.get('dtype')!r}, which the NCCL "
                             "transport does not send")
        start, end = entry["data_offsets"]
        shape = tuple(int(x) for x in entry["shape"])
        if end - start != math.prod(shape) * ITEM_BYTES[dtype]:
            raise ValueError(f"{path.name}: {name}'s byte range does not match its shape and dtype")
        out.append(TensorMeta(name, dtype, shape, path.name, 8 + size + start, end - start))
    return sorted(out, key=lambda t: t.offset)


def version_tensors(directory: str | Path, files: Iterable[str]) -> list[TensorMeta]:
    """Every tensor of a version's safetensors `files` (its manifest's), file by file in
    name order: the order rank 0 sends them in and `update_info` names them in."""
    directory = Path(directory)
    return [t for name in sorted(f for f in files if f.endswith(".safetensors"))
            for t in read_header(directory / name)]


def update_info(tensors: Sequence[TensorMeta]) -> dict:
    """`/update_weights`' {"update_info": ...} (vLLM's NCCLWeightTransferUpdateInfo)."""
    return {"names": [t.name for t in tensors], "dtype_names": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors]}


def chunk_plan(sizes: Sequence[int], buffer_bytes: int = BUFFER_BYTES) -> list[list[int]]:
    """The packed broadcasts: lists of indexes into `sizes` (bytes per tensor, in order),
    cut where vLLM's packed_nccl_broadcast_consumer cuts them."""
    out: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        current.append(i)
        total += n
        if total > buffer_bytes:
            out.append(current)
            current, total = [], 0
    if current:
        out.append(current)
    return out


def init_info(unique_id: bytes, world_size: int, buffer_bytes: int = BUFFER_BYTES) -> dict:
    """`/init_weight_transfer_engine`'s {"init_info": ...} (NCCLWeightTransferInitInfo, the
    unique-id rendezvous: no TCP store of vLLM's on rank 0)."""
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
    check_world_size(world_size)
    return {"nccl_unique_id_b64": base64.b64encode(unique_id).decode(), "rank_offset": RANK_OFFSET,
            "world_size": world_size, "packed": True, "packed_buffer_size_bytes": buffer_bytes,
            "packed_num_buffers": NUM_BUFFERS}


def check_world_size(world_size: object) -> int:
    """Rank 0 and the engine's workers: 2 .. MAX_WORLD."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 2 <= world_size <= MAX_WORLD:
        raise ValueError(f"world_size must be a whole number from 2 to {MAX_WORLD} (rank 0 and the engine's "
                         f"workers), not {world_size!r}")
    return world_size
