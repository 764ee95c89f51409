"""Model backends: the only package that imports torch and transformers.

`base` (torch-free) defines what the rest of the runtime sees of an engine; `loader.load_engine` builds
one from the config.
"""
