"""Chat sessions without the program syntax.

    async with client.session(system="You are terse.", temperature=0) as chat:
        reply = await chat.send("What is 2 + 2?")
        async with chat.stream("And 3 + 3?") as s:
            async for delta in s:
                print(delta.text, end="")
        a, b = await chat.fork(2)     # two continuations of the same history

Each send appends only the new user message to the engine session (rendered as a
template delta); the history is never re-sent or re-tokenized, so ``cached_tokens`` of
turn N+1 covers all of turn N. Forked sessions are closed with their parent.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
from radixlm.runtime.protocol import (
    ForkSession,
    Generate,
    Input,
    Message,
    Ok,
    Retention,
    SessionsForked,
    ToolDoneSoon,
)
from radixlm.sdk.errors import EngineError, ProgramError
from radixlm.sdk.results import GenerateResult, result_from_done
from radixlm.sdk.text_stream import TextStream

if TYPE_CHECKING:
    from radixlm.sdk.client import AsyncClient
    from radixlm.sdk.options import TurnOptions
    from typing_extensions import Unpack

__all__ = ["AsyncChatSession"]


class AsyncChatSession:
    """One engine session holding a conversation. Open it with ``async with``."""

    def __init__(
        self,
        client: AsyncClient,
        *,
        system: str | None = None,
        pin: str | None = None,
        retention: Retention = "hard",
        ttl_s: float | None = None,
        namespace: str | None = None,
        sampling: dict[str, Any] | None = None,
        durable: bool = False,
        _session: str | None = None,
        _history: list[dict[str, str]] | None = None,
        _length: int = 0,
    ) -> None:
        self._client = client
        self._system = system
        self._pin = pin
        self._retention: Retention = retention
        self._ttl_s = ttl_s
        self._namespace = namespace
        self.sampling: dict[str, Any] = dict(sampling or {})
        self.durable = durable  # outlives this client: the `with` block leaves it open
        self.id: str | None = _session
        self.history: list[dict[str, str]] = list(_history or [])
        self.length = _length  # tokens of history held by the engine
        self._children: list[AsyncChatSession] = []

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> AsyncChatSession:
        if self.id is not None:
            return self
        messages = None
        if self._system is not None:
            messages = [{"role": "system", "content": self._system}]
        opened = await self._client.open_session(
            messages=messages, pin=self._pin, retention=self._retention, ttl_s=self._ttl_s,
            namespace=self._namespace, durable=self.durable,
        )
        self.id = opened.session
        self.length = opened.length
        self.durable = opened.durable  # (granted only by a server that keeps state)
        if self._system is not None:
            self.history.append({"role": "system", "content": self._system})
        return self

    async def close(self) -> None:
        """Close this session and every session forked from it (idempotent)."""
        children, self._children = self._children, []
        session, self.id = self.id, None
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for child in children:
                    tg.start_soon(child.close)
                if session is not None:
                    tg.start_soon(self._close_quietly, session)

    async def _close_quietly(self, session: str) -> None:
        with contextlib.suppress(EngineError):  # gone already (a departed client's are closed)
            await self._client.close_session(session)

    async def __aenter__(self) -> AsyncChatSession:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        if not self.durable:  # a durable session stays for `resume` (close() ends it)
            await self.close()

    # -- turns ----------------------------------------------------------------------------

    def _turn(self, content: str, role: str, stream: bool, sampling: Mapping[str, Any]
              ) -> Generate:
        if self.id is None:
            raise ProgramError("the chat session is not open (use `async with client.session()`)")
        options = {**self.sampling, **sampling}
        # A tool result answers one call: role="tool", tool_call_id=..., name=...
        message = Message(role=role, content=content,
                          tool_call_id=options.pop("tool_call_id", None),
                          name=options.pop("name", None))
        inp = Input(messages=[message], add_generation_prompt=True)
        return self._client.generate_message(inp, options, session=self.id, stream=stream)

    def _record(self, content: str, role: str, result: GenerateResult) -> None:
        self.history.append({"role": role, "content": content})
        reply: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            reply["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                   for c in result.tool_calls]
        self.history.append(reply)
        if result.meta_info.get("session_length") is not None:
            self.length = result.meta_info["session_length"]

    async def send(self, content: str, *, role: str = "user",
                   **sampling: Unpack[TurnOptions]) -> GenerateResult:
        """Append a message and generate the assistant's reply (a `GenerateResult`).

        ``tools=`` / ``tool_choice=`` apply to this turn (``result.tool_calls`` holds the
        calls); answer a call with ``send(result_text, role="tool", tool_call_id=call.id,
        name=call.name)``. Tools are shown to the model only by the session's first turn."""
        msg = self._turn(content, role, False, sampling)
        start = time.perf_counter()
        dones = await self._client.run_generate(msg)
        result = result_from_done(dones[0], time.perf_counter() - start)
        self._record(content, role, result)
        return result

    def stream(self, content: str, *, role: str = "user",
               **sampling: Unpack[TurnOptions]) -> TextStream:
        """Like `send`, streaming the reply; the history is updated when it finishes."""
        return TextStream(self._client, self._turn(content, role, True, sampling),
                          on_finish=lambda results: self._record(content, role, results[0]))

    async def tool_done_soon(self) -> None:
        """A hint that the result of the tool call this session's last reply made is near:
        the engine brings the conversation's KV back now if memory pressure let it go
        (from host memory or disk), so the ``send`` of the result finds it. Optional."""
        if self.id is None:
            raise ProgramError("the chat session is not open")
        await self._client.call(ToolDoneSoon(rid=self._client.new_rid(), session=self.id), Ok)

    async def fork(self, n: int = 1) -> list[AsyncChatSession]:
        """`n` sessions continuing this conversation independently (closed with this one)."""
        if self.id is None:
            raise ProgramError("the chat session is not open")
        forked = await self._client.call(
            ForkSession(rid=self._client.new_rid(), session=self.id, n=n), SessionsForked)
        children = [
            AsyncChatSession(self._client, retention=self._retention, ttl_s=self._ttl_s,
                             namespace=self._namespace, sampling=self.sampling,
                             durable=self.durable, _session=sid, _history=self.history,
                             _length=forked.length)
            for sid in forked.sessions
        ]
        self._children.extend(children)
        return children
