"""An approximate radix tree of what the router sent to each replica (SGLang's
cache-aware router keeps the same kind of tree).

The router does not tokenize: keys are strings built from requests (`keys.py`), so a
match length is in characters, an estimate of the prefix a replica's KV cache holds.
One tree serves every replica: a node records which replicas were sent its path and
when (`Node.seen`). A replica's share is bounded (`cap_chars`): past it, that replica's
least recently used leaves are forgotten, as its engine evicts LRU leaves.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet

__all__ = ["ApproxTree", "Match"]


class Node:
    """A run of key characters (`label`), the replicas sent it and when (`seen`: a
    use counter), and its children by their first character. Slots: the tree holds
    one per distinct run of every live key."""

    __slots__ = ("label", "parent", "children", "seen")

    def __init__(self, label: str, parent: Node | None, seen: dict[int, int] | None = None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, Node] = {}
        self.seen: dict[int, int] = {} if seen is None else seen


def _common(a: str, b: str, start: int) -> int:
    """Length of the common prefix of `a` and ``b[start:]``, by ``str.startswith`` (which
    compares in C: a label is often thousands of characters): galloping from 8
    characters, then bisection (keys mostly part a few characters into a label)."""
    if b.startswith(a, start):
        return len(a)
    top = min(len(a), len(b) - start)
    lo, step = 0, 8  # a prefix of lo chars matches
    while lo + step < top and b.startswith(a[lo:lo + step], start + lo):
        lo += step
        step *= 2
    hi = min(top, lo + step)  # the common prefix is at most this long
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[lo:mid], start + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class Match:
    """The nodes a key runs through in the tree (`ApproxTree.path`)."""

    __slots__ = ("nodes",)

    def __init__(self, nodes: list[tuple[Node, int]]) -> None:
        self.nodes = nodes

    def __iter__(self) -> Iterator[tuple[Node, int]]:
        return iter(self.nodes)

    def lengths(self) -> dict[int, int]:
        """Every replica's `length` at once (one pass over the path)."""
        found: dict[int, int] = {}
        for node, end in self.nodes:
            for replica in node.seen:
                found[replica] = end  # deeper nodes overwrite: the longest wins
        return found

    def continues(self) -> bool:
        """Whether the key runs through the whole of a leaf: it extends (or repeats) a
        key sent before that nothing sent since extends, as a conversation's next turn
        extends its last one."""
        if not self.nodes:
            return False
        node, end = self.nodes[-1]
        start = self.nodes[-2][1] if len(self.nodes) > 1 else 0
        return not node.children and end - start == len(node.label)

    def length(self, replica: int) -> int:
        """The characters of the key `replica`'s part of the tree covers."""
        for node, end in reversed(self.nodes):
            if replica in node.seen:
                return end
        return 0

    def longest(self, alive: AbstractSet[int], loads: Sequence[int]) -> tuple[int, int]:
        """(replica, characters) of the longest match among `alive`, the least loaded
        of those that tie (then the lowest index); (-1, 0) if none matches at all."""
        for node, end in reversed(self.nodes):
            best, best_load = -1, 0
            for replica in node.seen:
                if replica in alive:
                    load = loads[replica]
                    if best < 0 or load < best_load or (load == best_load and replica < best):
                        best, best_load = replica, load
            if best >= 0:
                return best, end
        return -1, 0


class ApproxTree:
    """Which prefixes each replica was sent, and how long a match each would give."""

    def __init__(self, cap_chars: int = 1 << 22) -> None:
        self.root = Node("", None)
        self.cap_chars = cap_chars
        self.chars: dict[int, int] = {}  # replica -> characters of the tree it holds
        self._clock = 0

    def match(self, key: str) -> dict[int, int]:
        """For each replica, the characters of `key` its part of the tree covers."""
        return self.path(key).lengths()

    def path(self, key: str) -> Match:
        """The nodes `key` runs through (deepest last), with how far into `key` each
        reaches: enough to ask about one replica, or the best, without visiting every
        replica each node records."""
        nodes: list[tuple[Node, int]] = []
        node, pos, size = self.root, 0, len(key)
        while pos < size:
            child = node.children.get(key[pos])
            if child is None:
                break
            label = child.label
            if key.startswith(label, pos):  # the usual case: one C call, no search
                pos += len(label)
                nodes.append((child, pos))
                node = child
                continue
            pos += _common(label, key, pos)
            nodes.append((child, pos))
            break
        return Match(nodes)

    def insert(self, key: str, replica: int, match: Match | None = None) -> None:
        """`replica` was sent `key` (now): every node on its path records it. `match`:
        ``path(key)``, taken since the tree last changed (the walk starts where it ends)."""
        self._clock += 1
        now = self._clock
        node, pos = self.root, 0
        added = 0
        for child, end in match or ():
            if end - pos < len(child.label):  # the key parts inside it: split there
                child = self._split(child, end - pos)
            if replica not in child.seen:
                added += len(child.label)
            child.seen[replica] = now
            node, pos = child, end
        size = len(key)
        while pos < size:
            child = node.children.get(key[pos])
            if child is None:
                leaf = Node(key[pos:], node)
                node.children[key[pos]] = leaf
                child, n = leaf, size - pos
            elif key.startswith(child.label, pos):
                n = len(child.label)
            else:
                n = _common(child.label, key, pos)
                child = self._split(child, n)
            if replica not in child.seen:
                added += len(child.label)
            child.seen[replica] = now
            pos += n
            node = child
        if added:
            self.chars[replica] = self.chars.get(replica, 0) + added
            if self.chars[replica] > self.cap_chars:
                self._evict(replica, self.chars[replica] - self.cap_chars * 9 // 10)

    def remove_replica(self, replica: int) -> None:
        """Forget everything `replica` was sent (it died: its cache is gone)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            node.seen.pop(replica, None)
            stack.extend(node.children.values())
        self._prune(self.root)
        self.chars.pop(replica, None)

    def remove_prefix(self, prefix: str) -> None:
        """Forget every key that starts with `prefix` (a tenant flushed its cache)."""
        node, pos = self.root, 0
        while pos < len(prefix):
            child = node.children.get(prefix[pos])
            if child is None:
                return
            n = _common(child.label, prefix, pos)
            if pos + n == len(prefix):  # the child's path covers the prefix: drop it all
                self._drop(child)
                return
            if n < len(child.label):
                return
            pos += n
            node = child

    # -- internals -------------------------------------------------------------------------

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s label after `n` characters; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = Node(child.label[:n], parent, seen=dict(child.seen))
        parent.children[upper.label[0]] = upper
        child.label = child.label[n:]
        child.parent = upper
        upper.children[child.label[0]] = child
        return upper

    def _drop(self, node: Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            for replica in n.seen:
                self.chars[replica] = self.chars.get(replica, 0) - len(n.label)
            stack.extend(n.children.values())
        parent = node.parent
        assert parent is not None
        del parent.children[node.label[0]]

    def _prune(self, node: Node) -> None:
        for key, child in list(node.children.items()):
            self._prune(child)
            if not child.seen and not child.children:
                del node.children[key]

    def _evict(self, replica: int, chars: int) -> None:
        """Forget `replica`'s least recently used leaves until `chars` are gone."""
        heap: list[tuple[int, int, Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            held = [c for c in node.children.values() if replica in c.seen]
            if node is not self.root and replica in node.seen and not held:
                heap.append((node.seen[replica], id(node), node))
            stack.extend(held)
        heapq.heapify(heap)
        while heap and chars > 0:
            _, _, node = heapq.heappop(heap)
            del node.seen[replica]
            chars -= len(node.label)
            self.chars[replica] -= len(node.label)
            parent = node.parent
            if not node.seen and not node.children and parent is not None:
                del parent.children[node.label[0]]
            if (parent is not None and parent is not self.root and replica in parent.seen
                    and not any(replica in c.seen for c in parent.children.values())):
                heapq.heappush(heap, (parent.seen[replica], id(parent), parent))
