"""vLLM's engine under carpool (`model.engine: vllm`, or `auto` where vLLM serves the model).

    launch    the supervisor's side: find vLLM's environment, decide `auto`, start the engine there
    args      carpool's config as vLLM's engine arguments (pure)
    core      the task core under carpool's busy loop: admission, deadlines, priorities, LoRA names,
              metrics (pure; drives a backend)
    backend   vLLM's engine core in carpool's engine process (imports vllm)
    convert   a GGUF source converted once to a folder vLLM serves (imports transformers)
    __main__  the entry points run with vLLM's interpreter: probe, serve, worker

Only `backend`, `convert` and `__main__` import vllm, torch or transformers, and only in vLLM's
environment; nothing outside this package imports vllm (an import-linter contract).
"""
