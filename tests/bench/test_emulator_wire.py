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


def test_sglang_event_batches_are_byte_identical_to_sglangs() -> None:
    """``--kind sglang``: the events SGLang's own structs encode (one per page, its salt
    a field of its own on each, hashes signed int64, the batch's DP rank always there)."""
    from sglang.srt.disaggregation import kv_events as ske  # make setup installs SGLang
    t = toks(6, 32)
    big = 2**64 - 5  # an unsigned page hash past int64: SGLang's are signed
    ours = ev.encode_batch([ev.sglang_stored(big, None, t[:16], "salt"),
                            ev.sglang_stored(12, big, t[16:], "salt"), ev.sglang_removed(big),
                            ev.AllBlocksCleared()], ts=1.5, kind="sglang")
    theirs = msgspec.msgpack.Encoder().encode(ske.KVEventBatch(ts=1.5, events=[
        ske.BlockStored(block_hashes=[-5], parent_block_hash=None, token_ids=t[:16],
                        block_size=16, lora_id=None, medium=ske.StorageMedium.GPU,
                        cache_salt="salt"),
        ske.BlockStored(block_hashes=[12], parent_block_hash=-5, token_ids=t[16:],
                        block_size=16, lora_id=None, medium=ske.StorageMedium.GPU,
                        cache_salt="salt"),
        ske.BlockRemoved(block_hashes=[-5], medium=ske.StorageMedium.GPU),
        ske.AllBlocksCleared()], attn_dp_rank=0))
    assert ours == theirs
