"""Recording the reference: the hooks that capture every point's call, `moe-parity golden` (and
its placement, memory and dispatch; the reference read by `reference`), tiny models, and the `audit`
and `estimate` commands. What recording shares with replay (the lazy model, the architecture table,
the checkpoint reader, the call and KV-cache helpers) lives in `model`."""
