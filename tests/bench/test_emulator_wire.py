"""The engine emulator's KV event batches are byte for byte the ones vLLM's own classes
encode (vLLM imported here: it runs in make test's parallel pass, unlike the emulator's
timing tests in tests/bench/test_emulator.py)."""

from __future__ import annotations

import random

import msgspec

from benchmarks.emulator import events as ev


def toks(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(10, 8000) for _ in range(n)]


def test_event_batches_are_byte_identical_to_vllms() -> None:
    from vllm.distributed import kv_events as kve  # make setup installs vLLM: never a skip
    t = toks(5, 32)
    ours = ev.encode_batch([ev.stored([11, 12], None, t, 16, "salt"), ev.removed(11),
                            ev.AllBlocksCleared()], ts=1.5)
    theirs = msgspec.msgpack.Encoder().encode(kve.KVEventBatch(ts=1.5, events=[
        kve.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=t,
                        block_size=16, lora_id=None, medium="GPU", lora_name=None,
                        extra_keys=[("salt",), None], group_idx=0),
        kve.BlockRemoved(block_hashes=[11], medium="GPU", group_idx=0),
        kve.AllBlocksCleared()], data_parallel_rank=0))
    assert ours == theirs
