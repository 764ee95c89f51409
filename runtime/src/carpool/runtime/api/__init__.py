"""HTTP front: one router per protocol (OpenAI, KServe v2, health and metrics) over a `Frontend`, which
tokenizes and talks to the engine process through `client.EngineClient`."""
