"""Operator start-up, log-in and clean-up: settings, the shared state, and the API connection."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import kopf

from carpool.operator import GROUP
from carpool.operator.informer import CHILD_INDEX_PREFIX, Informer
from carpool.operator.reconcile import OperatorState
from carpool.operator.token import SERVICE_ACCOUNT_TOKEN, TokenFile, expires_for_reread, kubeconfig_token_file


def state_of(memo: Any) -> OperatorState:
    """The shared state; created here when the operator was started by plain `kopf run`."""
    state = getattr(memo, "carpool", None)
    if state is None:
        state = memo.carpool = OperatorState()
    assert isinstance(state, OperatorState)
    return state


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    state = state_of(memo)
    # kopf's indexes of the children and pods (live objects, filled once the watches start): the
    # reconciles read them as an informer's store.
    indices = {name: value for name, value in kwargs.items() if name.startswith(CHILD_INDEX_PREFIX)}
    if indices:
        state.informer = Informer(indices)
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
    if state.connection is not None:
        state.kube.connect(state.connection)
        return state.connection
    info, token_file = rotating_login(**kwargs)
    if info is not None:
        state.kube.connect(info, token_file)
    return info


def rotating_login(**kwargs: Any) -> tuple[kopf.ConnectionInfo | None, Path | None]:
    """kopf's own login, with a token file kept track of: the pod's projected service-account token,
    or a kubeconfig user's `tokenFile` (which kopf's kubeconfig login does not read). Credentials from
    a file expire after `token.REREAD_SECONDS`, so kopf logs in again and reads the rotated token."""
    info = kopf.login_with_service_account(**kwargs)
    path: Path | None = SERVICE_ACCOUNT_TOKEN
    if info is None:
        info = kopf.login_with_kubeconfig(**kwargs)
        path = kubeconfig_token_file()
        if info is not None and path is not None:
            info = dataclasses.replace(info, token=TokenFile(path).token() or None)
    if info is None or path is None:
        return info, None
    return dataclasses.replace(info, expiration=expires_for_reread()), path


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await state_of(memo).kube.close()
