"""Handlers for BatchedModel objects: every spec or label change, creation and operator restart."""

from __future__ import annotations

from typing import Any

import kopf

from carpool.operator import GROUP, PLURAL, VERSION
from carpool.operator.handlers.lifecycle import state_of
from carpool.operator.reconcile import reconcile


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_batched_model(
    body: kopf.Body, memo: kopf.Memo, reason: str, logger: kopf.Logger, **_: Any
) -> None:
    await reconcile(state_of(memo), dict(body), trigger=str(reason), logger=logger)
