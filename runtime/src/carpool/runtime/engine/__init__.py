"""The engine process: the model, its scheduler and warm-up, in a process of its own.

`process` is the entry point `carpool serve` starts (load, warm up, serve); `core` holds the busy loop
(schedule -> run -> complete) fed by an input thread and drained by an output thread that only move
bytes between ZeroMQ sockets and queues, as vLLM's `EngineCoreProc` does; `encoder` and `generation`
are the two task families the loop drives, each over the pure schedulers of `batching`.
"""
