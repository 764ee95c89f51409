"""Dynamic batching: who waits, who goes next, and in what batch (pure: the engine process drives it).

`queue` holds the admission and ordering policy (limits, priorities, deadlines); `former` decides
when to cut a batch and what goes in it (size, window, token budget, length grouping); `scheduler`
combines them behind `schedule(now)` / `complete(batch)`; `continuous` schedules text generation one
step at a time. These are pure and clock-injected. `runner` executes one batch (out-of-memory splitting).
Nothing here imports the engines, the engine process or the HTTP fronts.
"""
