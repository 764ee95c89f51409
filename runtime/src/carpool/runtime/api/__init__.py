"""HTTP front: one router per protocol (OpenAI, KServe v2, health and metrics) over `ModelService`."""
