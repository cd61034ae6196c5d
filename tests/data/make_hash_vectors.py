"""Regenerate tests/data/hash_vectors.json from an independent reading of the key spec.

The spec: docs/architecture.md §The key spec.

Uses xxhash's streaming API and struct packing rather than kvcentric.hashing, so the
vectors check the implementation instead of restating it. A block with extra keys (LoRA,
multimodal, prompt embeddings) chains ``"kvc-x"`` and xxh3_128 of the msgpack array of its
keys after its tokens.
"""

import json
import struct
from pathlib import Path

import msgspec
import xxhash

CASES = [
    {"model_id": "tiny-llama", "cache_salt": "", "block_size": 4, "tokens": list(range(10))},
    {"model_id": "tiny-llama", "cache_salt": "tenant-a", "block_size": 4,
     "tokens": list(range(10))},
    {"model_id": "meta-llama/Llama-3.1-8B", "cache_salt": "", "block_size": 16,
     "tokens": [(i * 7919) % 128256 for i in range(40)]},
    {"model_id": "m", "cache_salt": "", "block_size": 256, "tokens": [2**32 - 1] * 512 + [5]},
    {"model_id": "m", "cache_salt": "", "block_size": 8, "tokens": [1, 2, 3]},
    {"model_id": "tiny-llama", "cache_salt": "", "block_size": 4, "tokens": list(range(12)),
     "extras": [[["lora", "adapter-a", "/adapters/a"]], None,
                [["lora", "adapter-a", "/adapters/a"], ["mm", "f00d", 2]]]},
]
LAYOUT_SIG = "0123456789abcdef"


def chain(seed: bytes, tokens: list[int], bs: int, extras: list | None) -> list[str]:
    prev = xxhash.xxh3_128(seed).digest()
    out = []
    for b in range(len(tokens) // bs):
        h = xxhash.xxh3_128()
        h.update(prev)
        h.update(struct.pack(f"<{bs}I", *tokens[b * bs:(b + 1) * bs]))
        if extras and extras[b]:
            h.update(b"kvc-x")
            h.update(xxhash.xxh3_128(msgspec.msgpack.encode(extras[b])).digest())
        prev = h.digest()
        out.append(prev.hex())
    return out


def main() -> None:
    vectors = []
    for c in CASES:
        seed = f"{c['model_id']}|{c['cache_salt']}".encode()
        hashes = chain(seed, c["tokens"], c["block_size"], c.get("extras"))
        keys = [f"kvc/v2/{c['model_id']}/{LAYOUT_SIG}/1of2/{h}" for h in hashes]
        vectors.append({**c, "seed_utf8": seed.decode(), "layout_sig": LAYOUT_SIG,
                        "tp_rank": 1, "tp_size": 2, "hashes": hashes, "keys": keys})
    out = Path(__file__).with_name("hash_vectors.json")
    spec = "docs/architecture.md §The key spec, xxh3_128 chained"
    out.write_text(json.dumps({"spec": spec, "vectors": vectors}, indent=1) + "\n")


if __name__ == "__main__":
    main()
