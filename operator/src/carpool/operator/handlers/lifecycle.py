"""Operator start-up, log-in and clean-up: settings, the shared state, and the API connection."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from carpool.operator import GROUP
from carpool.operator.reconcile import OperatorState


def state_of(memo: Any) -> OperatorState:
    """The shared state; created here when the operator was started by plain `kopf run`."""
    state = getattr(memo, "carpool", None)
    if state is None:
        state = memo.carpool = OperatorState()
    assert isinstance(state, OperatorState)
    return state


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    state_of(memo)
    # kopf's bookkeeping goes into annotations, so the status schema stays strict and typed.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Watch only carpool's children and pods: the label selector goes to the API server.
    from carpool.operator.handlers.children import (
        CHILD_RESOURCES,
        MANAGED_SELECTOR,
        POD_RESOURCE,
        POD_SELECTOR,
    )

    for group, _version, plural in CHILD_RESOURCES:
        settings.watching.label_selectors[group, plural] = MANAGED_SELECTOR
    settings.watching.label_selectors[POD_RESOURCE[0], POD_RESOURCE[2]] = POD_SELECTOR
    # Only warnings become Kubernetes Events; routine progress stays in the operator's log.
    settings.posting.level = logging.WARNING


@kopf.on.login()
async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, then kubeconfig; the reconciler's client uses the same."""
    state = state_of(memo)
    info = (
        state.connection or kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    )
    if info is not None:
        state.kube.connect(info)
    return info


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await state_of(memo).kube.close()
