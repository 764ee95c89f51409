"""Dynamic batching: who waits, who goes next, and in what batch.

`queue` holds the admission and ordering policy (limits, priorities, deadlines); `former` decides
when to cut a batch and what goes in it (size, window, token budget, length grouping); `scheduler`
combines them behind `schedule(now)` / `complete(batch)`; these three are pure and clock-injected.
`runner` executes one batch (out-of-memory splitting); `loop` is the asyncio driver that owns the
worker thread.
"""
