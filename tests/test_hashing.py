import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcentric.hashing import KeySpace, block_hashes, extra_digest, hash_seed
from kvcentric.stored_layout import KVLayout

VECTORS = json.loads((Path(__file__).parent / "data" / "hash_vectors.json").read_text())["vectors"]


@pytest.mark.parametrize("v", VECTORS, ids=lambda v: f"{v['model_id']}-{v['block_size']}")
def test_vectors(v: dict) -> None:
    seed = hash_seed(v["model_id"], v["cache_salt"])
    assert seed.decode() == v["seed_utf8"]
    extras = [extra_digest(x) for x in v["extras"]] if "extras" in v else None
    hashes = block_hashes(v["tokens"], v["block_size"], seed, extras=extras)
    assert [h.hex() for h in hashes] == v["hashes"]
    ks = KeySpace(v["model_id"], v["layout_sig"], v["tp_rank"], v["tp_size"])
    assert ks.keys(hashes) == v["keys"]


def test_full_blocks_only_and_chaining() -> None:
    seed = hash_seed("m")
    toks = list(range(1000, 1037))
    hs = block_hashes(toks, 8, seed)
    assert len(hs) == 4 and all(len(h) == 16 for h in hs)
    # changing a token in block 1 changes block 1 and every later hash, not block 0
    toks2 = toks.copy()
    toks2[9] += 1
    hs2 = block_hashes(toks2, 8, seed)
    assert hs2[0] == hs[0] and all(a != b for a, b in zip(hs[1:], hs2[1:]))
    # incremental extension equals hashing the whole prefix at once
    assert block_hashes(toks[16:32], 8, seed, parent=hs[1]) == hs[2:4]
    assert block_hashes(np.array(toks, dtype=np.int64), 8, seed) == hs


def test_salt_and_model_isolate() -> None:
    toks = list(range(64))
    base = block_hashes(toks, 16, hash_seed("m"))
    assert block_hashes(toks, 16, hash_seed("m", "tenant")) != base
    assert block_hashes(toks, 16, hash_seed("m2")) != base


@pytest.mark.parametrize("bad", [[-1], [2**32], [[1, 2]]])
def test_bad_tokens(bad: list) -> None:
    with pytest.raises(ValueError):
        block_hashes(bad, 1, hash_seed("m"))


def test_bad_args() -> None:
    with pytest.raises(ValueError):
        block_hashes([1], 0, hash_seed("m"))
    with pytest.raises(ValueError):
        hash_seed("")
    with pytest.raises(ValueError):
        KeySpace("m", "sig", 2, 2)
    with pytest.raises(ValueError):
        KeySpace("m", "a/b")


def test_layout_signature_separates_everything() -> None:
    base = KVLayout(num_layers=4, block_size=128, num_kv_heads=2, head_dim=64,
                    dtype="bfloat16", layout="cpu:LBHNC:amx")
    assert base.bytes_per_layer == 2 * 128 * 2 * 64 * 2
    sigs = {base.signature()}
    for change in ({"num_layers": 5}, {"block_size": 256}, {"num_kv_heads": 4},
                   {"head_dim": 128}, {"dtype": "float16"}, {"layout": "cuda:LBNHC"},
                   {"mla": True}):
        sigs.add(KVLayout(**{**base.__dict__, **change}).signature())
    assert len(sigs) == 8
    with pytest.raises(ValueError):
        KVLayout(4, 128, 2, 64, "float64", "cpu:LBHNC")
    with pytest.raises(ValueError):
        KVLayout(4, 128, 2, 64, "float16", "bad layout/name")


SCRIPT = """
from kvcentric.hashing import KeySpace, block_hashes, extra_digest, hash_seed
hs = block_hashes(list(range(5000)), 256, hash_seed("model-x", "salt"))
print(",".join(KeySpace("model-x", "abcd", 0, 1).keys(hs)))
"""


def test_deterministic_across_processes_and_hash_seeds() -> None:
    outs = []
    for hseed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hseed}
        outs.append(subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True,
                                   capture_output=True, text=True).stdout)
    assert outs[0] == outs[1] and outs[0].count("kvc/v2/model-x/abcd/0of1/") == 19


def test_tails_never_collide_with_blocks_or_other_prefixes() -> None:
    from kvcentric.hashing import KeySpace, TailRef, prompt_tail, root_hash, tail_hash

    seed = hash_seed("m")
    toks = list(range(10, 10 + 2 * 16 + 5))  # two blocks of 16 and a 5-token tail
    hashes = block_hashes(toks, 16, seed)
    tail = prompt_tail(toks, 16, seed, hashes)
    assert tail == TailRef(tail_hash(hashes[-1], toks[32:]), 5)
    ks = KeySpace("m", "0123456789abcdef")
    assert ks.tail_key(tail) == ks.prefix + f"t5-{tail.digest.hex()}"
    assert ks.key_of(tail) != ks.key_of(tail.digest) and ks.key_of(hashes[0]) == ks.key(hashes[0])
    # one token more or less, another token, another parent chain, another salt: other keys
    others = [prompt_tail(toks[:-1], 16, seed, hashes), prompt_tail(toks + [1], 16, seed, hashes),
              prompt_tail(toks[:-1] + [7], 16, seed, hashes),
              prompt_tail([1] + toks[1:], 16, seed, block_hashes([1] + toks[1:], 16, seed)),
              prompt_tail(toks, 16, hash_seed("m", "s"), block_hashes(toks, 16,
                                                                      hash_seed("m", "s")))]
    assert len({ks.tail_key(t) for t in others if t is not None} | {ks.tail_key(tail)}) == 6
    # a tail of 0 or 1 tokens is never worth a key; a prompt under one block has one
    assert prompt_tail(toks[:32], 16, seed, hashes) is None
    assert prompt_tail(toks[:33], 16, seed, hashes) is None
    short = prompt_tail(toks[:7], 16, seed, [])
    assert short == TailRef(tail_hash(root_hash(seed), toks[:7]), 7)
    # the tail tag keeps a tail apart from a block of the same tokens
    assert tail_hash(hashes[0], toks[16:32]) != hashes[1]


def test_extra_keys_separate_blocks_and_tails() -> None:
    """A block's extra keys (LoRA adapter, multimodal input, prompt embeddings) change its
    hash and every later one; no extra keys hash exactly as before; tuples and lists of
    the same keys are the same keys; values msgpack cannot encode are refused."""
    from kvcentric.hashing import prompt_tail

    seed = hash_seed("m")
    toks = list(range(40))
    plain = block_hashes(toks, 8, seed)
    assert block_hashes(toks, 8, seed, extras=[None] * 5) == plain
    lora_a = extra_digest([("lora", "a", "/p/a")])
    lora_b = extra_digest([("lora", "b", "/p/b")])
    assert extra_digest([]) is None and lora_a == extra_digest([["lora", "a", "/p/a"]])
    with_a = block_hashes(toks, 8, seed, extras=[lora_a] * 5)
    with_b = block_hashes(toks, 8, seed, extras=[lora_b] * 5)
    assert len({*plain, *with_a, *with_b}) == 15
    image = block_hashes(toks, 8, seed, extras=[None, None, extra_digest([("mm", "x", 3)])])
    assert image[:2] == plain[:2] and not set(image[2:]) & set(plain)
    embeds = [extra_digest([("prompt_embeds", bytes([i]) * 32)]) for i in range(2)]
    assert embeds[0] != embeds[1]
    t_plain = prompt_tail(toks[:21], 8, seed, plain[:2])
    t_a = prompt_tail(toks[:21], 8, seed, plain[:2], lora_a)
    assert t_plain is not None and t_a is not None and t_plain.digest != t_a.digest
    with pytest.raises(TypeError):
        extra_digest([("mm", object())])
