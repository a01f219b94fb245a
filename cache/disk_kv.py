"""`DiskKV`: blocks of KV on disk, found by a chain of prefix hashes, checksummed.

A block is `layout.block_tokens` consecutive tokens of one namespace's sequence and their
K/V in every layer. Its key is a link in a hash chain: the root is a hash of the
namespace (a tenant's namespaces never share a chain with another tenant's), and block
i's key hashes block i-1's key with block i's tokens (`chain_keys`). So a key names the
exact token prefix that ends with its block, and the longest run of a prompt's blocks on
disk is found by walking the prompt's keys (`present_prefix`), never by comparing tokens.

One file per block, ``<dir>/<tenant digest>/<key>.kv``::

    b"RLKV" | format u8 | header length u32 | header (JSON: layout, key, parent, tenant)
    | tokens int32[block] | K bytes | V bytes | blake2b-128 of everything before it

written to a temporary name and renamed, so a reader sees a whole file or none. A read
checks the magic, the layout, the key, the parent, the tokens and the checksum: any
mismatch (a torn write after a power cut, a flipped bit, a file of another layout) is a
miss, and the file is removed. Nothing on disk is trusted without it.

Writes and reads run on one I/O thread of the store's own (reads first: a request waits
on them), never on the caller's thread; writes queue up to `max_pending_bytes`, beyond
which a block is not written (it is only recomputed if ever needed). The store is
bounded (`capacity_bytes`): past it the least recently used blocks go first, those of a
tenant over its share (`tenant_share`) before anyone else's. A failed write (a full disk,
a read-only file system) is logged once and the store keeps serving what it has.

Blocks are bytes to the store: the caller hands it K and V of a block as uint8 arrays
(`layout.k_bytes` each) and gets them back the same way.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import heapq
import itertools
import json
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"RLKV"
FORMAT = 1
DIGEST = 16  # bytes of the blake2b checksum at the end of a file
_HEAD = struct.Struct("<4sBI")  # magic, format, header length
SUFFIX = ".kv"
QUIET_S = 600.0  # a write failure is logged at most this often

log = logging.getLogger("radixlm.cache.disk")


@dataclass(frozen=True)
class KVLayout:
    """What one block of K/V holds: shape and element type, as the KV pool has them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16" | "float32"
    block_tokens: int

    @property
    def element_bytes(self) -> int:
        return {"float16": 2, "bfloat16": 2, "float32": 4}[self.dtype]

    @property
    def k_bytes(self) -> int:
        """Bytes of K (or of V) of one block, all layers."""
        return (self.num_layers * self.block_tokens * self.num_kv_heads * self.head_dim
                * self.element_bytes)

    @property
    def file_bytes(self) -> int:
        return 2 * self.k_bytes + 4 * self.block_tokens  # + header and checksum


def namespace_root(namespace: str | None) -> bytes:
    """The chain's root for one (engine-side) namespace: tenants are namespaces' heads."""
    return hashlib.blake2b(b"radixlm-kv\0" + (namespace or "").encode() + b"\0",
                           digest_size=16).digest()


def chain_keys(namespace: str | None, tokens: np.ndarray, block_tokens: int,
               start_key: bytes | None = None, start_block: int = 0) -> list[bytes]:
    """The key of every whole block of `tokens` (from block `start_block`, whose parent
    key `start_key` the caller already has, if given)."""
    key = start_key if start_key is not None else namespace_root(namespace)
    ids = np.ascontiguousarray(tokens, dtype=np.int64)
    keys = []
    for b in range(start_block, len(ids) // block_tokens):
        chunk = ids[b * block_tokens:(b + 1) * block_tokens].tobytes()
        key = hashlib.blake2b(key + chunk, digest_size=16).digest()
        keys.append(key)
    return keys


@dataclass(frozen=True)
class Block:
    """One block read back: its tokens and its K/V bytes."""

    key: bytes
    tokens: np.ndarray  # int64 [block_tokens]
    k: np.ndarray  # uint8 [layout.k_bytes]
    v: np.ndarray


@dataclass
class _Entry:
    tenant: str
    size: int
    last_used: float


@dataclass(order=True)
class _Job:
    priority: int  # 0: read, 1: write
    seq: int
    run: Callable[[], None] = field(compare=False)


class DiskKV:
    """A bounded, checksummed store of KV blocks in a directory of its own."""

    def __init__(self, directory: Path, layout: KVLayout, capacity_bytes: int, *,
                 tenant_share: float = 0.25, max_pending_bytes: int = 256 * 2**20) -> None:
        self.dir = Path(directory)
        self.layout = layout
        self.capacity = capacity_bytes
        self.tenant_share = tenant_share  # the least share of the capacity a tenant keeps
        self.max_pending = max_pending_bytes
        self.failing: str | None = None
        self._said_at = -QUIET_S  # when a write failure was last logged (monotonic)
        self._said = False
        self.counters = {"written": 0, "write_dropped": 0, "write_failed": 0, "read": 0,
                         "missed": 0, "corrupt": 0, "evicted": 0}
        self._header = json.dumps({"layout": asdict(layout)}, sort_keys=True)
        self._lock = threading.Lock()  # the index, the counters and the pending count
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self._tenant_bytes: dict[str, int] = {}
        self._pending = 0
        self._pending_keys: set[bytes] = set()
        self._reading: set[bytes] = set()
        self._jobs: list[_Job] = []
        self._cv = threading.Condition(self._lock)
        self._seq = itertools.count()
        self._stop = False
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._scan()
        self._thread = threading.Thread(target=self._run, name="disk-kv", daemon=True)
        self._thread.start()

    # -- the index -----------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the index from the files (start-up): least recently used first."""
        found = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.suffix != SUFFIX:
                    with contextlib.suppress(OSError):
                        f.unlink()  # a temporary file a crash left behind
                    continue
                try:
                    st = f.stat()
                    key = bytes.fromhex(f.stem)
                except (OSError, ValueError):
                    continue
                found.append((st.st_mtime, key, sub.name, st.st_size))
        with self._lock:
            for mtime, key, tenant, size in sorted(found):
                self._index[key] = _Entry(tenant, size, mtime)
                self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
            self._evict_locked()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._tenant_bytes.values())

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def present_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, have a block on disk (or on its way)."""
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._index and key not in self._pending_keys:
                    break
                n += 1
            return n

    def tenant_bytes(self, tenant: str) -> int:
        with self._lock:
            return self._tenant_bytes.get(_tenant_dir(tenant), 0)

    # -- writing -------------------------------------------------------------------------
    def put(self, tenant: str, key: bytes, parent: bytes, tokens: np.ndarray,
            k: np.ndarray, v: np.ndarray) -> bool:
        """Queue one block for writing (the arrays are the caller's to drop: they are not
        copied again). False when it is not queued: already there, or too much pending."""
        lay = self.layout
        if len(tokens) != lay.block_tokens or k.nbytes != lay.k_bytes or v.nbytes != lay.k_bytes:
            raise ValueError("a block must have block_tokens tokens and layout.k_bytes of K and V")
        size = lay.file_bytes
        with self._lock:
            if key in self._index:
                self._touch_locked(key)
                return False
            if key in self._pending_keys:
                return False
            if self._pending + size > self.max_pending:
                self.counters["write_dropped"] += 1
                return False
            self._pending += size
            self._pending_keys.add(key)
            self._submit_locked(1, lambda: self._write(tenant, key, parent, tokens, k, v, size))
        return True

    def _write(self, tenant: str, key: bytes, parent: bytes, tokens: np.ndarray,
               k: np.ndarray, v: np.ndarray, size: int) -> None:
        sub = self.dir / _tenant_dir(tenant)
        path = sub / (key.hex() + SUFFIX)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        header = json.dumps({"layout": asdict(self.layout), "key": key.hex(),
                             "parent": parent.hex(), "tenant": tenant}, sort_keys=True).encode()
        try:
            sub.mkdir(mode=0o700, exist_ok=True)
            h = hashlib.blake2b(digest_size=DIGEST)
            with open(tmp, "wb") as f:
                for part in (_HEAD.pack(MAGIC, FORMAT, len(header)), header,
                             np.ascontiguousarray(tokens, dtype=np.int32).tobytes(),
                             memoryview(np.ascontiguousarray(k)).cast("B"),
                             memoryview(np.ascontiguousarray(v)).cast("B")):
                    h.update(part)
                    f.write(part)
                f.write(h.digest())
            os.replace(tmp, path)
            written = path.stat().st_size
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            with self._lock:
                self._pending -= size
                self._pending_keys.discard(key)
                self.counters["write_failed"] += 1
                now = time.monotonic()
                say = self.failing is None and now - self._said_at >= QUIET_S
                if say:
                    self._said_at, self._said = now, True
                self.failing = _why(e)
            if say:
                log.error("disk KV tier: cannot write to %s (%s): KV is not saved to disk "
                          "until it can; the server keeps serving", self.dir, self.failing)
            return
        with self._lock:
            self._pending -= size
            self._pending_keys.discard(key)
            if self.failing is not None:
                if self._said:
                    log.warning("disk KV tier: writes to %s work again", self.dir)
                self.failing, self._said = None, False
            self._index[key] = _Entry(_tenant_dir(tenant), written, time.time())
            t = _tenant_dir(tenant)
            self._tenant_bytes[t] = self._tenant_bytes.get(t, 0) + written
            self.counters["written"] += 1
            self._evict_locked()

    # -- reading -------------------------------------------------------------------------
    def read(self, tenant: str, keys: Sequence[bytes], parents: Sequence[bytes],
             tokens: Sequence[np.ndarray],
             done: Callable[[list[Block]], None]) -> None:
        """Read blocks `keys` (each under `parents[i]`, holding `tokens[i]`) on the I/O
        thread, then call `done(blocks)` there with the leading run that read back whole
        and true (fewer than asked when one is missing or fails its checks)."""
        with self._lock:
            self._reading.update(keys)
            self._submit_locked(0, lambda: self._read(tenant, list(keys), list(parents),
                                                      list(tokens), done))

    def _read(self, tenant: str, keys: list[bytes], parents: list[bytes],
              tokens: list[np.ndarray], done: Callable[[list[Block]], None]) -> None:
        blocks: list[Block] = []
        try:
            for key, parent, toks in zip(keys, parents, tokens, strict=True):
                block = self._read_one(tenant, key, parent, toks)
                if block is None:
                    break
                blocks.append(block)
        finally:
            with self._lock:
                self._reading.difference_update(keys)
        done(blocks)

    def _read_one(self, tenant: str, key: bytes, parent: bytes,
                  tokens: np.ndarray) -> Block | None:
        path = self.dir / _tenant_dir(tenant) / (key.hex() + SUFFIX)
        try:
            data = path.read_bytes()
        except OSError:
            with self._lock:
                self.counters["missed"] += 1
                self._forget_locked(key)
            return None
        block = self._parse(data, tenant, key, parent, tokens)
        with self._lock:
            if block is None:
                self.counters["corrupt"] += 1
                self._forget_locked(key)
            else:
                self.counters["read"] += 1
                self._touch_locked(key)
        if block is None:
            log.warning("disk KV tier: %s failed its checks; removed (recomputed instead)",
                        path.name)
            with contextlib.suppress(OSError):
                path.unlink()
        else:
            with contextlib.suppress(OSError):
                os.utime(path)  # LRU order survives a restart
        return block

    def _parse(self, data: bytes, tenant: str, key: bytes, parent: bytes,
               tokens: np.ndarray) -> Block | None:
        lay = self.layout
        if len(data) < _HEAD.size + DIGEST:
            return None
        body, digest = data[:-DIGEST], data[-DIGEST:]
        if hashlib.blake2b(body, digest_size=DIGEST).digest() != digest:
            return None
        magic, fmt, hlen = _HEAD.unpack_from(body)
        if magic != MAGIC or fmt != FORMAT:
            return None
        try:
            header = json.loads(body[_HEAD.size:_HEAD.size + hlen])
        except ValueError:
            return None
        if (header.get("layout") != asdict(lay) or header.get("key") != key.hex()
                or header.get("parent") != parent.hex() or header.get("tenant") != tenant):
            return None
        pos = _HEAD.size + hlen
        n_tok = 4 * lay.block_tokens
        if len(body) != pos + n_tok + 2 * lay.k_bytes:
            return None
        toks = np.frombuffer(body, dtype=np.int32, count=lay.block_tokens, offset=pos)
        if not np.array_equal(toks, np.asarray(tokens)):
            return None
        raw = np.frombuffer(body, dtype=np.uint8, offset=pos + n_tok)
        return Block(key, toks.astype(np.int64), raw[:lay.k_bytes], raw[lay.k_bytes:])

    # -- bounds --------------------------------------------------------------------------
    def _touch_locked(self, key: bytes) -> None:
        entry = self._index.get(key)
        if entry is not None:
            entry.last_used = time.time()
            self._index.move_to_end(key)

    def _forget_locked(self, key: bytes) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._tenant_bytes[entry.tenant] -= entry.size

    def _evict_locked(self) -> None:
        """Past the capacity: drop least recently used blocks, a tenant over its share
        first (its share: the capacity over the tenants with blocks, `tenant_share` of
        it at least)."""
        total = sum(self._tenant_bytes.values())
        if total <= self.capacity:
            return
        tenants = [t for t, b in self._tenant_bytes.items() if b > 0]
        share = max(self.capacity / max(1, len(tenants)), self.capacity * self.tenant_share)
        victims: list[bytes] = []
        over = {t for t in tenants if self._tenant_bytes[t] > share}
        for key, entry in list(self._index.items()):
            if total <= self.capacity:
                break
            if key in self._reading or (over and entry.tenant not in over):
                continue
            victims.append(key)
            total -= entry.size
            if entry.tenant in over and self._tenant_bytes[entry.tenant] - entry.size <= share:
                over.discard(entry.tenant)
            self._forget_locked(key)
        for key, entry in list(self._index.items()):  # still over: anyone's, LRU first
            if total <= self.capacity:
                break
            if key in self._reading:
                continue
            victims.append(key)
            total -= entry.size
            self._forget_locked(key)
        for key in victims:
            self.counters["evicted"] += 1
            self._submit_locked(1, lambda key=key: self._unlink(key))

    def _unlink(self, key: bytes) -> None:
        for path in self.dir.glob(f"*/{key.hex()}{SUFFIX}"):
            with self._lock:
                if key in self._index:
                    return  # written again meanwhile
            with contextlib.suppress(OSError):
                path.unlink()

    def drop_tenant(self, tenant: str) -> int:
        """Forget every block of `tenant` (its cache flushed): bytes freed."""
        t = _tenant_dir(tenant)
        with self._lock:
            keys = [k for k, e in self._index.items() if e.tenant == t]
            freed = 0
            for key in keys:
                freed += self._index[key].size
                self._forget_locked(key)
                self._submit_locked(1, lambda key=key: self._unlink(key))
            return freed

    # -- the I/O thread ------------------------------------------------------------------
    def _submit_locked(self, priority: int, run: Callable[[], None]) -> None:
        heapq.heappush(self._jobs, _Job(priority, next(self._seq), run))
        self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = heapq.heappop(self._jobs)
            try:
                job.run()
            except Exception:  # noqa: BLE001 - the thread must outlive one bad job
                log.exception("disk KV tier: an I/O job failed")

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every job queued before this call has run."""
        done = threading.Event()
        with self._lock:
            self._submit_locked(2, done.set)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued writes, then stop the I/O thread."""
        with self._lock:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout_s)


def _tenant_dir(tenant: str) -> str:
    """A tenant's folder: a digest of its name (names may hold any character)."""
    return hashlib.blake2b(tenant.encode(), digest_size=8).hexdigest()


def _why(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "disk full"
    if e.errno == errno.EROFS:
        return "read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return e.strerror or str(e)
