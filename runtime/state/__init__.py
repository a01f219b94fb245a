"""radixlm.runtime.state: what a server keeps across disconnects, crashes and restarts.

- `location`: the state directory (``--state-dir``; by default
  ``$XDG_STATE_HOME/radixlm``), opened 0700 and locked by one server at a time, with one
  subdirectory per model fingerprint;
- `fingerprint`: the identity of a model as served (weights file, dtype, KV dtype, page
  size, tokenizer): state made under another fingerprint is never used;
- `db`: `StateDB`, one SQLite database (WAL) written by one thread of its own, never on
  a caller's hot path; what a reply acknowledges is committed before the reply is sent.

Torch-free: the launcher, the engine, the HTTP process and the router use it.
"""
