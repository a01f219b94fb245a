"""Replicas behind one endpoint: ``radixlm router`` and ``radixlm serve --replicas N``.

The router is a protocol client of each replica and a protocol server to its own clients
(docs/protocol.md, unchanged). `server.Router` runs the loop and the clients' side and
holds the parts: replica links and health (replicas.py), clients' requests and replies
(requests.py) with the session table (sessions.py) and pins (pins.py), session-affine,
cache-aware routing (routing.py, policy.py, prefix_tree.py), fan-outs with merged
replies (fanout.py, merge.py), and failover by rebuilding sessions from their logs
(failover.py, records.py, replay.py). docs/deployment.md is the user's page.
"""
