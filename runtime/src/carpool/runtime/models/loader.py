"""Builds the engine the config asks for. Called once, off the event loop, at start-up.

torch and the transformers engines are imported only when a real model loads: a process serving the null
engine (`model.engine: zeros`) never imports them.
"""

from __future__ import annotations

import logging
import time

from carpool.runtime.config import EngineKind, RuntimeConfig, Task
from carpool.runtime.models.base import AnyEngine
from carpool.runtime.models.buckets import bucket_grid
from carpool.runtime.sources import resolve_source
from carpool.runtime.warmup import warmup_shapes

log = logging.getLogger(__name__)


def load_engine(config: RuntimeConfig) -> AnyEngine:
    """Load the model named by `config.model`; raises ConfigError when it cannot work."""
    started = time.monotonic()
    model = config.model
    if model.engine is EngineKind.ZEROS:
        from carpool.runtime.models.null import NullEngine

        null = NullEngine(model, config.served_name())
        log.warning(
            "model.engine zeros (the null engine): every input answered with zeros of shape [%d] "
            "(tokenizer of %s); for measuring the front, never for real traffic",
            null.info.dimensions or len(null.info.labels),
            model.source,
        )
        return null
    import torch

    from carpool.runtime.models.classification import ClassificationEngine
    from carpool.runtime.models.device import choose_device, choose_precision
    from carpool.runtime.models.embedding import EmbeddingEngine
    from carpool.runtime.models.generation import GenerationEngine

    source = resolve_source(model.source)
    device = choose_device(model.device)
    precision = choose_precision(model.dtype, device, task=model.task)
    dtype = precision.dtype
    log.info("%s: serving in %s", precision.reason, str(dtype).removeprefix("torch."))
    if model.torch_threads:
        torch.set_num_threads(model.torch_threads)
    engine: AnyEngine
    if model.task is Task.EMBED:
        engine = EmbeddingEngine(source, model, config.served_name(), device, dtype)
    elif model.task in (Task.CLASSIFY, Task.RERANK):
        engine = ClassificationEngine(source, model, config.served_name(), device, dtype)
    else:
        engine = GenerationEngine(
            source, model, config.generation, config.served_name(), device, dtype, config.lora
        )
    log.info(
        "loaded %s from %s (%s) on %s as %s (quantization %s) in %.2fs; inputs up to %d tokens",
        engine.info.name,
        model.source,
        source.location,
        engine.info.device,
        engine.info.dtype,
        engine.info.quantization,
        time.monotonic() - started,
        engine.info.max_input_tokens,
    )
    if isinstance(engine, EmbeddingEngine | ClassificationEngine):
        # Before warm-up, so warm-up and the padding calibration run through the graphs they will serve with.
        shapes = warmup_shapes(config.warmup, config.batching, engine.info.max_input_tokens)
        engine.prepare(bucket_grid(shapes, config.batching.max_batch_tokens))
    return engine
