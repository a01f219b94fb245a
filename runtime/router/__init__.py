"""Replicas behind one endpoint: ``radixlm router`` and ``radixlm serve --replicas N``.

The router is a protocol client of each replica and a protocol server to its own clients
(docs/protocol.md, unchanged): session-affine, cache-aware routing (routing.py,
policy.py, prefix_tree.py), failover by rebuilding sessions from their logs (records.py,
replay.py), fanned-out stats and listings (merge.py). docs/deployment.md is the user's
page.
"""
