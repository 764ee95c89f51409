"""kopf handlers: short functions that hand the work to `carpool.operator.reconcile`.

Importing this package registers them on kopf's default registry (`kopf run -m
carpool.operator.handlers` works as well as `carpool operator`).
"""

from __future__ import annotations

from carpool.operator.handlers import batchedmodel, children, lifecycle

__all__ = ["batchedmodel", "children", "lifecycle"]
