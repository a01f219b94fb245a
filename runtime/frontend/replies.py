"""What the engine sends, on its way to the clients.

`StepOutputs` become Chunks and Dones (streams.py: the frontend only detokenizes and
streams; the engine has ended every turn). `ToClient` replies are forwarded as they are,
read only for liveness bookkeeping (the rid a client waits on) and a tenant's names;
one that ends a Generate (an Error refusing or failing it) says so in `ends`.
"""

from __future__ import annotations

import logging

import msgspec
from radixlm.runtime import protocol as wire
from radixlm.runtime.engine.wire import EngineAbort, EngineReady, StepOutputs, ToClient, TokenOutput
from radixlm.runtime.frontend.clients import ClientState, Routes
from radixlm.runtime.frontend.streams import RequestStream

log = logging.getLogger("radixlm.frontend")


class EngineReplies:
    """The engine's messages, turned into replies to its clients."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def on_message(self, msg: StepOutputs | ToClient | EngineReady) -> None:
        if isinstance(msg, StepOutputs):
            self.on_step(msg.outputs)
        elif isinstance(msg, ToClient):
            self.on_reply(msg)
        else:
            log.warning("unexpected EngineReady while serving (engine restarted?)")

    def on_step(self, outputs: list[TokenOutput]) -> None:
        """One scheduler step's outputs. The common case (a streamed token of a running
        request) is handled inline: this loop runs once per token of every request."""
        routes = self.routes
        streams = routes.streams
        encode_reply = routes.encode_reply
        send = routes.send
        for out in outputs:
            stream = streams.get(out.key)
            if stream is None:
                continue  # its client is gone (or an error already ended it)
            try:
                if out.finish_reason is None:
                    chunk = stream.on_output(out).chunk
                    if chunk is not None:
                        send(stream.client, encode_reply(chunk))
                else:
                    self._on_last_output(stream, out)
            except Exception as e:  # a bug: fail this request, keep serving the rest
                log.exception("output of request key %d failed", out.key)
                self.fail_request(out.key, f"{type(e).__name__}: {e}")

    def _on_last_output(self, stream: RequestStream, out: TokenOutput) -> None:
        """The output that ends a branch: its last chunk and its Done."""
        routes = self.routes
        if out.finish_reason == "error":  # the engine sent the client an Error for it
            routes.end_request(stream)
            return
        chunk, done = stream.on_output(out)
        if chunk is not None and not routes.send(stream.client, wire.encode(chunk)):
            return
        if done is not None:
            if not routes.send(stream.client, wire.encode(done)):
                return
            if stream.remaining == 0:
                routes.end_request(stream)

    def fail_request(self, key: int, message: str) -> None:
        routes = self.routes
        stream = routes.streams.get(key)
        if stream is None:
            return
        routes.end_request(stream)
        routes.to_engine(None, EngineAbort(key=key))
        client = routes.clients.get(stream.client)
        if client is not None:
            routes.error(client, stream.rid, wire.ErrorCode.INTERNAL, message)

    def on_reply(self, msg: ToClient) -> None:
        routes = self.routes
        client = routes.clients.get(msg.client)
        if client is None:
            return  # gone (or a liveness probe's reply); the engine has been told
        if msg.ends is not None:  # the engine refused or failed a Generate (session busy, ...)
            stream = routes.streams.get(msg.ends)
            if stream is not None and stream.client == msg.client:
                routes.end_request(stream)
        try:
            reply = wire.decode_server(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.error("engine sent an undecodable reply: %r", msg.data[:200])
            return
        rid = getattr(reply, "rid", None)
        if rid is not None:
            if client.abandoned and rid in client.abandoned:
                client.abandoned.discard(rid)  # already failed as engine_unavailable
                return
            client.awaiting.discard(rid)
        outer = in_tenant_terms(client, reply)
        routes.send(msg.client, msg.data if outer is None else wire.encode(outer))


def in_tenant_terms(client: ClientState, reply: wire.ServerMessage) -> wire.ServerMessage | None:
    """The reply as the client may see it (None: as it is): the engine's names for its
    namespaces and pins put back, other tenants' sessions left out, activity counters of
    a shared server hidden."""
    names = client.names
    if names.tenant is None:
        return None
    if isinstance(reply, wire.Error):
        message = names.scrub(reply.message)
        return None if message == reply.message else msgspec.structs.replace(reply, message=message)
    if isinstance(reply, wire.SessionList):
        return names.sessions(reply)
    if isinstance(reply, wire.Pinned):
        return names.pinned(reply)
    if isinstance(reply, wire.StatsReply):
        return msgspec.structs.replace(
            reply, sessions=0, pins=0, retained_tokens={}, prompt_tokens_total=0,
            cached_tokens_total=0, hit_rate=0.0, generated_tokens_total=0, retractions=0,
            fair_preemptions=0, capped_steps=0, finish_reasons={}, latency={}, tool_waits={},
            tool_round_trip_s={}, prefetch={})
    return None
