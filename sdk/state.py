"""`ProgramState`: the `s` of an ``@rl.function`` -- what the program body sees.

Appending (``s += ...``, ``fork``, ``join``) only records operations in the run; reads
(``s["x"]``, ``s.text()``, ``text_iter``) wait for the operations they depend on, while
everything else keeps running concurrently in the client's event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import anyio
from radixlm.sdk.errors import ProgramError
from radixlm.sdk.executor import ForkOp, JoinOp, StateExecutor
from radixlm.sdk.lang import RoleScopes, flatten
from radixlm.sdk.run import await_future
from radixlm.sdk.state_data import SetVarOp

if TYPE_CHECKING:
    from radixlm.sdk.run import ProgramRun

__all__ = ["ProgramState", "ProgramStateGroup"]


class ProgramState(RoleScopes):
    """The state of a running program (``s``): append with ``+=``, read with ``s[name]``;
    roles and variable scopes also as methods (``with s.user(): ...``, `RoleScopes`).

    Reads wait for the operations they depend on; the rest runs concurrently.
    """

    def __init__(self, run: ProgramRun, executor: StateExecutor) -> None:
        self._run = run
        self._executor = executor
        self._data = executor.data  # written by the executor only
        self.ret_value: Any = None

    # -- appending --------------------------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("tried to append None to a program state")
        self._run.submit_all(self._executor, flatten(other))
        return self

    def __setitem__(self, name: str, value: Any) -> None:
        """Set variable `name` (``s[name] = value``; SGLang's ``set_var``). After the
        program ended (``state["x"] = int(state["x"])`` on a run's result) it is set at
        once, once the state's last operations ran."""
        executor = self._executor
        if not executor.end_submitted:
            self._run.submit(executor, SetVarOp(name, value))
            return
        self.sync()  # its executor is done: nothing else writes the state any more
        self._data.set_var(name, value)

    set_var = __setitem__

    def _append(self, items: list[Any]) -> None:  # what `RoleScopes` appends with
        self._run.submit_all(self._executor, items)

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`size` copies of this state continuing independently from here: one engine
        ``ForkSession``, no prefix re-sent. ``join()`` gathers their variables back.
        (`position_ids_offset` is SGLang's; its interpreter ignores it, and so does this.)"""
        size = int(size)
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        new_executor = self._run.new_executor
        children = tuple([new_executor(forked=True) for _ in range(size)])
        self._run.submit(self._executor, ForkOp(children))
        return ProgramStateGroup([ProgramState(self._run, c) for c in children], self)

    def copy(self, position_ids_offset: Any = None) -> _CopiedState:
        """One fork of this state; as a context manager it is joined back on exit."""
        child = self.fork(1, position_ids_offset)
        return _CopiedState(child, self)

    # -- reading (blocking) --------------------------------------------------------------------

    def _target(self) -> int:
        return self._executor.submitted

    def _raise_if_failed(self) -> None:
        error = self._executor.error or self._run.body_error
        if error is not None:
            raise error

    def sync(self) -> None:
        """Wait until every operation appended so far has run."""
        target, executor = self._target(), self._executor
        self._run.block_until(lambda: executor.settled(target))

    def get_var(self, name: Any) -> Any:
        """``s[name]``: the variable's value, waiting until the gen/select that sets it ran."""
        executor, data, target = self._executor, self._data, self._target()
        self._run.block_until(lambda: name in data.var_done or executor.settled(target))
        return self._value(name)

    __getitem__ = get_var

    def _value(self, name: Any) -> Any:
        if name in self._data.var_done:
            return self._data.variables[name]
        self._raise_if_failed()
        raise KeyError(f"the program state has no variable {name!r}")

    def get(self, name: Any, default: Any = None) -> Any:
        """`s[name]` once every operation appended so far ran, or `default` if the program
        never set it."""
        self.sync()
        return self._value(name) if name in self._data.var_done else default

    def __contains__(self, name: Any) -> bool:
        self.sync()
        return name in self._data.var_done

    def get_meta_info(self, name: Any) -> Any:
        """SGLang-style meta info of a gen/select: prompt_tokens, cached_tokens,
        completion_tokens, finish_reason (and more; a list after gen(n=k) or join)."""
        self.get_var(name)
        return self._data.meta.get(name)

    def text(self) -> str:
        """The state's whole text so far (waits for every appended operation)."""
        self.sync()
        self._raise_if_failed()
        return self._data.text

    def messages(self) -> list[dict[str, str]]:
        """The chat messages so far, as role/content dicts (waits like `text`)."""
        self.sync()
        self._raise_if_failed()
        return list(self._data.messages)

    @property
    def variables(self) -> dict[Any, Any]:
        """Every variable set so far (waits like `text`)."""
        self.sync()
        data = self._data
        return {k: v for k, v in data.variables.items() if k in data.var_done}

    def error(self) -> BaseException | None:
        """The error that stopped this state (or its program), if any."""
        self.sync()
        return self._executor.error or self._run.body_error

    # -- reading (async) ------------------------------------------------------------------------

    async def wait(self) -> None:
        """Like `sync`, from async code."""
        target, executor = self._target(), self._executor
        await self._run.await_until(lambda: executor.settled(target))

    async def aget(self, name: Any) -> Any:
        """Like ``s[name]``, from async code."""
        executor, data, target = self._executor, self._data, self._target()
        await self._run.await_until(lambda: name in data.var_done or executor.settled(target))
        return self._value(name)

    async def atext(self) -> str:
        """Like `text`, from async code."""
        await self.wait()
        self._raise_if_failed()
        return self._data.text

    # -- streaming -------------------------------------------------------------------------

    def text_iter(self, var_name: Any = None) -> Iterator[str]:
        """Yield the text of `var_name` (None: the whole state) as it is generated. Without
        ``stream=True`` on the run it yields the finished value once."""
        if not self._run.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        self._run.commit()
        cursor = 0
        while True:
            if self._run.in_loop_thread():
                raise ProgramError("text_iter() would block the event loop: use text_async_iter()")
            chunk, done = self._run._from_thread(anyio.from_thread.run, self._executor.next_text,
                                                 var_name, cursor)
            cursor += len(chunk)
            if chunk:
                yield chunk
            if done:
                break
        self._raise_if_failed()

    async def text_async_iter(self, var_name: Any = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """Async version of `text_iter`; with `return_meta_data`, yields (text, meta_info):
        while a gen streams, the meta of the tokens that piece covers (their
        ``output_token_logprobs``, the running ``completion_tokens``: see
        `radixlm.sdk.stream_meta`)."""
        if not self._run.stream:
            await self.wait()
            value = self._data.text if var_name is None else await self.aget(var_name)
            yield (value, self._data.meta.get(var_name)) if return_meta_data else value
            return
        self._run.commit()
        with_meta = return_meta_data and var_name is not None  # SGLang: text only for None
        cursor = tokens = 0
        executor = self._executor
        while True:
            if self._run.in_loop_thread():
                chunk, done, meta, tokens = await executor.next_piece(var_name, cursor, tokens)
            elif self._run.portal is not None:
                chunk, done, meta, tokens = await await_future(self._run.portal.start_task_soon(
                    executor.next_piece, var_name, cursor, tokens))
            else:
                raise ProgramError("this program state belongs to another event loop")
            cursor += len(chunk)
            if chunk:
                yield (chunk, meta) if with_meta else chunk
            if done:
                break
        self._raise_if_failed()

    def __repr__(self) -> str:
        executor = self._executor
        state = "finished" if executor.finished else "running"
        return (f"<ProgramState {state}, {self._data.buffer.length} chars, "
                f"session={executor.session.id}>")


class _CopiedState(ProgramState):
    """`ProgramState.copy()`: a fork of one; ``with s.copy() as c:`` joins it on exit."""

    def __init__(self, group: ProgramStateGroup, parent: ProgramState) -> None:
        only = group[0]
        super().__init__(only._run, only._executor)
        self._group = group

    def __enter__(self) -> _CopiedState:
        return self

    def __exit__(self, *exc: object) -> None:
        self._group.join()


class ProgramStateGroup:
    """The states `ProgramState.fork` made: ``forks += expr`` appends to each (a callable
    gets the index; a list gives one item per fork); ``join()`` gathers them back."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        """What ``forks[i] += expr`` ends with (Python stores the result back): the same
        state. Putting another state there is refused, as in SGLang."""
        if value is not self.states[i]:
            raise TypeError("a fork group's states cannot be replaced: append to them with "
                            "forks[i] += ...")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} items for {len(self.states)} forks")
            for state, item in zip(self.states, other, strict=False):
                state += item
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """End the forks and merge them into the parent: ``gather_variable`` (default) puts
        each new variable in the parent as a list (one item per fork);
        ``concate_and_append`` appends the forks' new text to the parent."""
        run = self.parent._run
        executors = tuple(s._executor for s in self.states)
        run.submit(self.parent._executor, JoinOp(executors, mode))
        for executor in executors:
            run.end(executor)
