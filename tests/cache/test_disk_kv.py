"""`DiskKV` against a brute-force reference: blocks read back exactly as written, found by
their prefix chain; anything torn, flipped or of another layout is a miss (never wrong
KV); bounded LRU with tenant shares; what was written is found again by a new store on
the same directory (a restart); a failed write is said once and the store keeps serving."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest
from radixlm.cache.disk_kv import Block, DiskKV, KVLayout, chain_keys, namespace_root

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16", block_tokens=8)


def _kv(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return (rng.integers(0, 256, LAYOUT.k_bytes, dtype=np.uint8),
            rng.integers(0, 256, LAYOUT.k_bytes, dtype=np.uint8))


def _write_sequence(store: DiskKV, tenant: str, namespace: str | None, tokens: np.ndarray,
                    rng: np.random.Generator) -> dict[bytes, tuple[np.ndarray, np.ndarray]]:
    keys = chain_keys(namespace, tokens, LAYOUT.block_tokens)
    parents = [namespace_root(namespace), *keys[:-1]]
    written = {}
    for i, (key, parent) in enumerate(zip(keys, parents, strict=True)):
        k, v = _kv(rng)
        store.put(tenant, key, parent, tokens[i * 8:(i + 1) * 8], k, v)
        written[key] = (k, v)
    assert store.flush()
    return written


def _read(store: DiskKV, tenant: str, namespace: str | None, tokens: np.ndarray) -> list[Block]:
    keys = chain_keys(namespace, tokens, LAYOUT.block_tokens)
    parents = [namespace_root(namespace), *keys[:-1]]
    got: list[Block] = []
    done = threading.Event()

    def finish(blocks: list[Block]) -> None:
        got.extend(blocks)
        done.set()

    store.read(tenant, keys, parents, [tokens[i * 8:(i + 1) * 8] for i in range(len(keys))],
               finish)
    assert done.wait(10)
    return got


def test_chain_keys_name_exact_prefixes() -> None:
    a = np.arange(32)
    b = a.copy()
    b[20] = 99  # differs in block 2
    ka, kb = chain_keys(None, a, 8), chain_keys(None, b, 8)
    assert len(ka) == 4 and ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]
    assert chain_keys("t1", a, 8)[0] != ka[0]  # another namespace, another chain
    assert chain_keys(None, a, 8, start_key=ka[1], start_block=2) == ka[2:]
    assert len(chain_keys(None, np.arange(31), 8)) == 3  # whole blocks only


def test_blocks_read_back_exactly_and_a_restart_finds_them(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 40)
    store = DiskKV(tmp_path, LAYOUT, 10 * 2**20)
    written = _write_sequence(store, "alice", "alice/ns", tokens, rng)
    keys = chain_keys("alice/ns", tokens, 8)
    assert store.present_prefix(keys) == 5
    store.close()
    again = DiskKV(tmp_path, LAYOUT, 10 * 2**20)  # a new process on the same directory
    assert again.present_prefix(keys) == 5
    blocks = _read(again, "alice", "alice/ns", tokens)
    assert [b.key for b in blocks] == keys
    for b in blocks:
        k, v = written[b.key]
        assert np.array_equal(b.k, k) and np.array_equal(b.v, v)
    assert np.array_equal(np.concatenate([b.tokens for b in blocks]), tokens[:40])
    again.close()


def test_another_tenant_or_namespace_finds_nothing(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 1000, 16)
    store = DiskKV(tmp_path, LAYOUT, 10 * 2**20)
    _write_sequence(store, "alice", "alice", tokens, rng)
    assert store.present_prefix(chain_keys("bob", tokens, 8)) == 0
    assert _read(store, "bob", "alice", tokens) == []  # alice's keys, asked as bob: a miss
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "layout", "tokens"])
def test_a_damaged_block_is_a_miss_and_removed(tmp_path: Path, damage: str) -> None:
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 1000, 24)
    store = DiskKV(tmp_path, LAYOUT, 10 * 2**20)
    _write_sequence(store, "t", None, tokens, rng)
    keys = chain_keys(None, tokens, 8)
    victim = next(tmp_path.glob(f"*/{keys[1].hex()}.kv"))
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 3]))
    store.close()
    layout = LAYOUT if damage != "layout" else KVLayout(2, 2, 4, "bfloat16", 8)
    store = DiskKV(tmp_path, layout, 10 * 2**20)
    read_tokens = tokens.copy()
    if damage == "tokens":  # a hash collision's stand-in: the file's tokens are checked too
        read_tokens[9] += 1
    keys_asked = chain_keys(None, tokens, 8)
    parents = [namespace_root(None), *keys_asked[:-1]]
    got: list[Block] = []
    done = threading.Event()
    store.read("t", keys_asked, parents,
               [read_tokens[i * 8:(i + 1) * 8] for i in range(3)],
               lambda b: (got.extend(b), done.set()))
    assert done.wait(10)
    if damage == "layout":
        assert got == []  # every block is of another layout
    else:
        assert [b.key for b in got] == keys[:1]  # the run stops at the damaged block
        assert store.counters["corrupt"] == 1
        assert not victim.exists() and store.present_prefix(keys) == 1
    store.close()


def test_the_store_is_bounded_lru(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    per_block = LAYOUT.file_bytes + 400  # + header and checksum, roughly
    store = DiskKV(tmp_path, LAYOUT, capacity_bytes=int(per_block * 6.5))
    seqs = [rng.integers(0, 1000, 16) for _ in range(5)]  # 2 blocks each
    for s in seqs[:3]:
        _write_sequence(store, "t", None, s, rng)
    assert store.num_blocks == 6
    _read(store, "t", None, seqs[0])  # the first becomes the most recent
    for s in seqs[3:]:
        _write_sequence(store, "t", None, s, rng)
    store.flush()
    present = [store.present_prefix(chain_keys(None, s, 8)) for s in seqs]
    assert store.used_bytes <= store.capacity
    assert present[0] == 2 and present[1] == 0 and present[4] == 2, present
    files = len(list(tmp_path.glob("*/*.kv")))
    assert files == store.num_blocks
    store.close()


def test_a_tenant_over_its_share_is_evicted_first(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    per_block = LAYOUT.file_bytes + 400
    store = DiskKV(tmp_path, LAYOUT, capacity_bytes=per_block * 8)
    quiet = rng.integers(0, 1000, 16)
    _write_sequence(store, "quiet", "quiet", quiet, rng)  # 2 blocks, written first (LRU)
    for _ in range(5):  # 10 blocks of the noisy tenant
        _write_sequence(store, "noisy", "noisy", rng.integers(0, 1000, 16), rng)
    assert store.present_prefix(chain_keys("quiet", quiet, 8)) == 2
    assert store.tenant_bytes("noisy") <= per_block * 6
    store.close()


def test_a_failed_write_is_said_once_and_reads_go_on(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(5)
    store = DiskKV(tmp_path, LAYOUT, 10 * 2**20)
    tokens = rng.integers(0, 1000, 16)
    _write_sequence(store, "t", None, tokens, rng)
    caplog.set_level(logging.WARNING, logger="radixlm.cache.disk")
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where a tenant's folder should be")
    import radixlm.cache.disk_kv as mod  # tenant "x"'s folder is a file: its writes fail

    real = mod._tenant_dir
    mod._tenant_dir = lambda t: "blocked" if t == "x" else real(t)
    try:
        for _ in range(3):
            _write_sequence(store, "x", None, rng.integers(0, 1000, 8), rng)
    finally:
        mod._tenant_dir = real
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "keeps serving" in errors[0].getMessage()
    assert store.counters["write_failed"] == 3 and store.failing
    assert len(_read(store, "t", None, tokens)) == 2  # what it has is still served
    _write_sequence(store, "t", None, rng.integers(0, 1000, 8), rng)
    assert store.failing is None
    store.close()


def test_writes_beyond_the_pending_bound_are_dropped_not_queued(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    store = DiskKV(tmp_path, LAYOUT, 10 * 2**20, max_pending_bytes=LAYOUT.file_bytes * 2)
    accepted = 0
    tokens = rng.integers(0, 1000, 80)
    keys = chain_keys(None, tokens, 8)
    gate = threading.Event()
    with store._lock:  # the I/O thread waits on this job, so writes pile up meanwhile
        store._submit_locked(0, lambda: gate.wait(10))
    for i, key in enumerate(keys):
        k, v = _kv(rng)
        accepted += store.put("t", key, b"p" * 16, tokens[i * 8:(i + 1) * 8], k, v)
    gate.set()
    store.flush()
    assert accepted == 2 and store.counters["write_dropped"] == len(keys) - 2
    store.close()
