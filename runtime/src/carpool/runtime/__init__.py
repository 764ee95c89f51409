"""carpool's model server: an HTTP front, a dynamic batcher and transformers engines.

Layers, outermost first: `api` (FastAPI routers, one per protocol) -> `service` (lifecycle: load,
warm up, serve, drain) -> `batching` (pure queue policy and batch formation, driven by an asyncio
loop) -> `models` (the model backends; the only package that imports torch).
"""
