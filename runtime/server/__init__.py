"""radixlm.runtime.server: starting, supervising and stopping a server's processes.

- `launcher`: `start_server` (the parent side: runtime directory, listeners bound
  first, children started and waited for) and `RunningServer`;
- `child`: one child process's entry point (``python -m radixlm.runtime.server.child``);
- `spec`: the typed spec a child starts with; `environment`: its environment (OpenMP,
  triton, the device check);
- `listeners`: the listening sockets, bound before any child starts; `rundir`: the
  runtime directory's files (owner, ready);
- `children`: signal-safe, bounded waits on child processes; `exits`: how a process
  ended, in words; `progress`: the start-up spinner.

Torch-free: the CLI and the SDK's `rl.Engine` import it.
"""
