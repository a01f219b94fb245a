"""The engine's answer to GetStats: pool sizes, retention, queues and hit rate."""

from __future__ import annotations

from radixlm.cache import CacheSizes
from radixlm.runtime.engine.sessions.controller import SessionController
from radixlm.runtime.engine.table import Counters, RequestTable
from radixlm.runtime.protocol import StatsReply


def stats_reply(rid: str, sizes: CacheSizes, table: RequestTable, counters: Counters,
                sessions: SessionController, capped_steps: int = 0,
                tenant: str | None = None) -> StatsReply:
    private = table.private_tokens()
    c = counters
    return StatsReply(
        rid=rid,
        capacity=sizes.capacity,
        free=sizes.free,
        evictable=sizes.evictable,
        protected=sizes.protected,
        private=private,
        running=len(table.running),
        waiting=len(table.waiting),
        prompt_tokens_total=c.prompt_tokens,
        cached_tokens_total=c.cached_tokens,
        hit_rate=c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        invariant_ok=sizes.free + sizes.evictable + sizes.protected + private == sizes.capacity,
        generated_tokens_total=c.generated_tokens + c.jumped_tokens,
        retractions=c.retractions,
        fair_preemptions=c.preemptions,
        capped_steps=capped_steps,
        finish_reasons=dict(c.latency.finish_reasons),
        latency=c.latency.wire(),
        **sessions.stats(tenant),
    )
