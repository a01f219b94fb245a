"""`radixlm top` on sessions waiting on tools: the line by tier with the prefetch hits
and misses, the tools' round trips, and each waiting session's tools and tier in the
session table; nothing of it for a server whose sessions never waited on a tool."""

from __future__ import annotations

from radixlm.runtime.cli.top import Sample, render, session_table
from radixlm.runtime.protocol import SessionInfo, StatsReply, Welcome

WELCOME = Welcome(protocol_version=1, server_version="x", model="m", context_length=256,
                  page_size=1, kv_capacity=100)


def stats(**tools) -> StatsReply:
    return StatsReply(rid="s", capacity=100, free=40, evictable=30, protected=30, private=0,
                      retained_tokens={"soft": 30}, retained_cap=50, host_capacity=200,
                      host_used=120, sessions=3, pins=0, running=0, waiting=0,
                      prompt_tokens_total=10, cached_tokens_total=5, hit_rate=0.5,
                      invariant_ok=True, generated_tokens_total=7, retractions=0,
                      fair_preemptions=0, capped_steps=0, finish_reasons={}, latency={},
                      **tools)


def test_tool_waits_tiers_round_trips_and_prefetches() -> None:
    s = stats(tool_waits={"device": 1, "host": 2}, tool_round_trip_s={"search": 1.25,
              "run_tests": 12.0}, prefetch={"started": 4, "hinted": 1, "hits": 3, "misses": 1})
    waiting = SessionInfo(session="a" * 32, length=900, idle_s=2.5, retention="demoted",
                          busy=False, tools=["search", "shell"], tier="host")
    plain = SessionInfo(session="b" * 32, length=40, idle_s=1.0, retention="soft", busy=False)
    text = "\n".join(render(WELCOME, "ipc://x", Sample(0.0, s, [waiting, plain]), None))
    assert "tool waits 3 (device 1  host 2)" in text, text
    assert "prefetch hits 3 misses 1 (75.0%)  started 4  hinted 1" in text
    assert "tool trips run_tests 12.00s  search 1.25s" in text
    rows = session_table([waiting, plain])
    assert rows[0].split()[-1] == "TOOLS"
    assert rows[1].split()[-1] == "search,shell@host"
    assert rows[2].split()[-1] == "-"


def test_nothing_about_tools_when_none_waited() -> None:
    text = "\n".join(render(WELCOME, "ipc://x", Sample(0.0, stats(), []), None))
    assert "tool" not in text
