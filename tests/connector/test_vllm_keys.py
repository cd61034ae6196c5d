"""Keys cover everything the KV depends on: vLLM ``Request`` objects through our scheduler
side, on a real local store (no engine: multimodal requests need a vision model vLLM CPU
cannot build from random weights here; LoRA and prompt embeddings run end to end in
tests/connector/test_vllm_inputs.py).

- Multimodal inputs key the blocks they overlap (placeholder token ids are identical for
  every image); blocks before the first image are shared with the text-only prompt.
- LoRA: the adapter (name, path and a digest of its files) keys every block.
- A request whose inputs cannot be keyed is neither looked up nor saved (counted).
- TP: a block counts as stored only when every rank's shard of it is.
- Model revision: new weights under the same name are another key space.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.scheduler import KVCentricScheduler
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.integrity import ObjectRef
from kvcentric.model_revision import directory_revision
from kvcentric.store import KVStore, open_store
from kvcentric.testing.adapters import build_lora
from kvcentric.testing.models import build_model
from tests.helpers.kv_worker import engine

BLOCK = 32  # stored block of the helper's engine layout (2 pages of 16)
PLACEHOLDER = 7


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[KVStore]:
    with open_store(store_cfg) as st:
        yield st


def scheduler(store: KVStore, layout: EngineLayout | None = None) -> KVCentricScheduler:
    return KVCentricScheduler(ConnectorSettings(), layout or engine("cpu"), store,
                              loads=True, saves=True)


def image(identifier: str | None, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,  # type: ignore[arg-type]
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def request(rid: str, tokens: list[int], **kw: object) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, **kw)  # type: ignore[arg-type]


def store_objects(store: KVStore, layout: EngineLayout, refs: list[ObjectRef]) -> None:
    """Put objects for ``refs`` as a worker would (header, zero payload)."""
    headers = layout.headers()
    buf = torch.zeros(headers.object_bytes, dtype=torch.uint8)
    for ref in refs:
        headers.write(buf.data_ptr(), ref)
        assert store.batch_put_from([ref.key(layout.keyspace)], [buf.data_ptr()],
                                    [headers.object_bytes]) == [0]


def test_multimodal_inputs_key_the_blocks_they_overlap(store: KVStore) -> None:
    text = list(range(100, 140))
    tokens = text + [PLACEHOLDER] * 50 + list(range(200, 210))  # image at [40, 90)
    sched = scheduler(store)
    with_a = request("a", tokens, mm_features=[image("img-a", 40, 50)])
    store_objects(store, sched.layout, sched.object_refs(with_a, len(tokens)))
    # the same image: everything but the last token; another image, or none: only the
    # block before the image ([0, 32): the image starts at 40)
    assert sched.get_num_new_matched_tokens(
        request("a2", tokens, mm_features=[image("img-a", 40, 50)]), 0) == (len(tokens) - 1,
                                                                             False)
    for other in (request("b", tokens, mm_features=[image("img-b", 40, 50)]),
                  request("moved", tokens, mm_features=[image("img-a", 41, 49)]),
                  request("text", tokens)):
        assert sched.get_num_new_matched_tokens(other, 0) == (BLOCK, False), other.request_id


def test_lora_adapters_and_their_revisions_key_every_block(store: KVStore,
                                                           tmp_path: Path) -> None:
    tokens = list(range(300, 370))
    a, b = build_lora("tiny", tmp_path / "a", seed=1), build_lora("tiny", tmp_path / "b", seed=2)
    sched = scheduler(store)

    def with_lora(rid: str, name: str, path: Path, int_id: int) -> Request:
        return request(rid, tokens, lora_request=LoRARequest(name, int_id, str(path)))

    store_objects(store, sched.layout, sched.object_refs(with_lora("w", "a", a, 1), 70))
    assert sched.get_num_new_matched_tokens(with_lora("r1", "a", a, 1), 0) == (69, False)
    assert sched.get_num_new_matched_tokens(with_lora("r2", "b", b, 2), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(request("r3", tokens), 0) == (0, False)
    # new weights under the same name and path: another adapter
    shutil.copy(b / "adapter_model.safetensors", a / "adapter_model.safetensors")
    assert sched.get_num_new_matched_tokens(with_lora("r4", "a", a, 1), 0) == (0, False)


def test_unkeyable_requests_are_neither_looked_up_nor_saved(store: KVStore) -> None:
    tokens = list(range(100, 140)) + [PLACEHOLDER] * 50
    sched = scheduler(store)
    plain = request("plain", tokens)
    store_objects(store, sched.layout, sched.object_refs(plain, len(tokens)))
    broken = request("broken", tokens, mm_features=[image(None, 40, 50)])  # no identifier
    sched.register_request(broken)
    assert sched.get_num_new_matched_tokens(broken, 0) == (0, False)
    sched.update_state_after_alloc(broken, None, 0)
    new = NewRequestData.from_request(broken, ([0, 1, 2, 3, 4, 5],))
    out = SchedulerOutput(scheduled_new_reqs=[new],
                          scheduled_cached_reqs=CachedRequestData.make_empty(),
                          num_scheduled_tokens={"broken": len(tokens)},
                          total_num_scheduled_tokens=len(tokens),
                          scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                          finished_req_ids=set(), free_encoder_mm_hashes=[])
    meta = sched.build_connector_meta(out)
    assert meta.saves == [] and meta.loads == []
    assert sched.stats.data["unkeyed_requests"] == 1
    assert sched.get_num_new_matched_tokens(plain, 0) == (len(tokens) - 1, False)


def test_tp_lookups_count_a_block_only_when_every_rank_stored_it(store: KVStore) -> None:
    tp = engine("cpu")
    tp = replace(tp, keyspace=replace(tp.keyspace, tp_size=2))
    sched = scheduler(store, tp)
    tokens = list(range(500, 600))
    req = request("tp", tokens)
    refs = sched.object_refs(req, len(tokens))
    store_objects(store, tp, refs)  # rank 0's shards only
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    rank1 = replace(tp, keyspace=replace(tp.keyspace, tp_rank=1))
    store_objects(store, rank1, refs[:2])  # rank 1: the first two blocks
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, False)
    store_objects(store, rank1, refs[2:])
    assert sched.get_num_new_matched_tokens(req, 0) == (len(tokens) - 1, False)


def test_new_weights_under_the_same_name_are_another_key_space(tmp_path: Path) -> None:
    model = build_model("tiny", Path.cwd() / ".models" / "tiny")
    copy = tmp_path / "tiny"
    shutil.copytree(model, copy)
    rev = directory_revision(copy)
    assert rev == directory_revision(model) and len(rev) == 32
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 1  # one bit of the last tensor, same size, same name
    weights.write_bytes(bytes(data))
    assert directory_revision(copy) not in (rev, "")
    layout = engine("cpu").layout
    assert replace(layout, revision=rev).signature() != replace(
        layout, revision=directory_revision(copy)).signature()
    assert directory_revision(tmp_path / "missing") == ""


def test_mla_keys_are_shared_by_tp_ranks_and_mha_keys_are_not() -> None:
    """vLLM's parallel config -> (key rank, key ranks, writer) per TP rank."""
    from vllm.config import ParallelConfig

    from kvcentric.connector.vllm.engine_layout import key_rank

    tp2 = ParallelConfig(tensor_parallel_size=2)
    assert [key_rank(tp2, False, r) for r in (0, 1)] == [(0, 2, True), (1, 2, True)]
    assert [key_rank(tp2, True, r) for r in (0, 1)] == [(0, 1, True), (0, 1, False)]
    dcp = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2)
    assert [key_rank(dcp, True, r) for r in range(4)] == [
        (0, 2, True), (1, 2, True), (0, 2, False), (1, 2, False)]
