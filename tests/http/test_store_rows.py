"""The HTTP store on its SQLite rows (runtime/http/state.py), without a server: objects
read back by id after a "restart" (a new store on the same file), per tenant; a held
session shared by several objects is closed exactly when the last of them goes, across
restarts; rows expire by the TTL; conversation items keep their order.

The reference is what was stored before the restart, and a plain count of who still
names each engine session."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from radixlm.runtime.http.history import MESSAGES_ONLY, chain_keys, root_key
from radixlm.runtime.http.state import HttpState, open_http_state
from radixlm.runtime.http.store import ConversationStore
from radixlm.runtime.protocol import Message

TTL = 100.0
HISTORY = [Message(role="user", content="hi"), Message(role="assistant", content="hello")]


class World:
    """A state directory, a clock, and the sessions closed so far."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.now = [1000.0]
        self.closed: list[str] = []
        self.state: HttpState | None = None

    def store(self, tenant: str = "a") -> ConversationStore:
        if self.state is None:
            self.state = open_http_state(str(self.root), "fp")
            assert self.state is not None
        store = ConversationStore(TTL, self.closed.extend, clock=lambda: self.now[0])
        store.attach(self.state.rows(tenant))
        return store

    def restart(self) -> None:
        assert self.state is not None
        asyncio.run(self.state.committed())
        self.state.close()
        self.state = None


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    if w.state is not None:
        w.state.close()


def _respond(store: ConversationStore, rid: str, session: str, history: list[Message]) -> None:
    root = root_key("Be brief.", None)
    held = store.index.hold(chain_keys(root, history)[-1],
                            chain_keys(MESSAGES_ONLY, history)[-1], session, 12)
    store.put_response(rid, held, history, {"id": rid, "output": []}, [{"id": "msg_1"}])


def test_objects_are_read_back_by_id_for_their_tenant_only(world: World) -> None:
    store = world.store()
    _respond(store, "resp_1", "s1", HISTORY)
    store.put("sess_1", "s2", 7, HISTORY)
    conv = store.new_conversation({"k": "v"}, [{"id": "i1", "type": "message", "role": "user",
                                                "content": []}])
    world.restart()
    store = world.store()
    entry = store.get("resp_1")
    assert entry is not None and entry.session == "s1" and entry.length == 12
    assert entry.history == HISTORY and entry.body == {"id": "resp_1", "output": []}
    assert entry.input_items == [{"id": "msg_1"}] and entry.held is not None
    chat = store.get("sess_1")
    assert chat is not None and chat.held is None and (chat.session, chat.length) == ("s2", 7)
    back = store.conversation(conv.id)
    assert back is not None and back.metadata == {"k": "v"} and back.items == conv.items
    # The held history is found by its chain key again (a request sending it whole).
    keys = chain_keys(root_key("Be brief.", None), [*HISTORY, Message(role="user", content="?")])
    found = store.index.find(keys, 3)
    assert found is not None and found[0] == 2 and found[1].session == "s1"
    other = world.store("b")
    assert other.get("resp_1") is None and other.get("sess_1") is None
    assert other.conversation(conv.id) is None and other.index.find(keys, 3) is None
    assert not world.closed


def test_a_shared_session_closes_when_its_last_holder_goes_across_restarts(world: World) -> None:
    store = world.store()
    _respond(store, "resp_1", "s1", HISTORY)
    _respond(store, "resp_2", "s9", HISTORY)  # the same history: s1 shared, s9 closed
    assert world.closed == ["s9"]
    conv = store.new_conversation({}, [])
    store.add_items(conv, [{"id": "m1", "type": "message", "role": "user",
                            "content": [{"type": "input_text", "text": "hi"}]},
                           {"id": "m2", "type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": "hello"}]}])
    assert conv.held is not None and conv.held.session == "s1"  # its items are that history
    world.restart()
    store = world.store()
    assert store.delete("resp_1")
    world.restart()
    store = world.store()
    assert store.delete("resp_2") and world.closed == ["s9"]  # the conversation holds s1
    assert store.delete_conversation(conv.id)
    assert world.closed == ["s9", "s1"]
    world.restart()
    store = world.store()
    keys = chain_keys(root_key("Be brief.", None), HISTORY)
    assert store.index.find(keys, 3) is None and store.get("resp_1") is None


def test_rows_expire_by_the_ttl_and_a_deletion_is_never_read_back(world: World) -> None:
    store = world.store()
    _respond(store, "resp_1", "s1", HISTORY)
    store.put("sess_1", "s2", 7, HISTORY)
    store.put("sess_2", "s3", 7, HISTORY)
    assert store.delete("sess_2") and world.closed == ["s3"]
    assert store.get("sess_2") is None  # (its deletion may not be committed yet)
    world.restart()
    store = world.store()
    world.now[0] += TTL * 0.5
    assert store.get("sess_1") is not None  # used: its TTL restarts (its row too)
    world.restart()
    store = world.store()
    world.now[0] += TTL * 0.7  # resp_1 idle 1.2 TTL, sess_1 0.7
    assert store.sweep() == 1 and sorted(world.closed) == ["s1", "s3"]
    assert store.get("resp_1") is None and store.get("sess_1") is not None


def test_conversation_items_keep_their_order_through_changes(world: World) -> None:
    store = world.store()
    item = {"type": "message", "role": "user", "content": []}
    conv = store.new_conversation({}, [{**item, "id": "a"}, {**item, "id": "b"}])
    store.add_items(conv, [{**item, "id": "c"}])
    store.delete_item(conv, 0)
    store.add_items(conv, [{**item, "id": "d"}, {**item, "id": "e"}])
    store.set_metadata(conv, {"topic": "x"})
    world.restart()
    store = world.store()
    back = store.conversation(conv.id)
    assert back is not None and [i["id"] for i in back.items] == ["b", "c", "d", "e"]
    assert back.metadata == {"topic": "x"}
    store.add_items(back, [{**item, "id": "f"}])
    world.restart()
    back = world.store().conversation(conv.id)
    assert back is not None and [i["id"] for i in back.items] == ["b", "c", "d", "e", "f"]


def test_a_held_row_nothing_names_is_let_go_by_the_sweep(world: World) -> None:
    """A crash between a held session's row and its response's leaves the first alone."""
    store = world.store()
    _respond(store, "resp_1", "s1", HISTORY)
    assert world.state is not None
    world.state.rows("a").save_held("s7", 5, b"k" * 32, b"c" * 32)  # named by nothing
    world.restart()
    store = world.store()
    store.sweep()
    assert world.closed == ["s7"]  # s1 is resp_1's
    world.restart()
    store = world.store()
    store.sweep()
    assert world.closed == ["s7"] and store.get("resp_1") is not None
