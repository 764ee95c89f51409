"""kmock's Kubernetes emulator, taught the one server-side apply behaviour the operator relies on.

The operator creates children with server-side apply (PATCH, `application/apply-patch+yaml`), which a
real API server turns into a create when the object is absent. kmock answers such a PATCH with 404, so
this emulator stores the object first (as a create would, with an ADDED watch event) and lets kmock's
own handling merge the patch into it. Field ownership, defaulting and pruning are still not emulated:
the tests assert what the operator *sends* (method, path, query, body; kmock records every request)
for those, and the pure decisions are unit-tested.

kmock also serves any resource it is written to; `unserved` (`group/version/plural`, set by the
`missing_apis` fixture) makes it answer 404 for those instead, as an API server does for an API that
is not installed (a CRD that is absent).
"""

from __future__ import annotations

from typing import Any

import aiohttp.web
import kmock

APPLY_PATCH = "application/apply-patch+yaml"


NOT_FOUND = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "reason": "NotFound",
    "code": 404,
    "message": "the server could not find the requested resource",
}


class ServerSideApplyEmulator(kmock.KubernetesEmulator):
    unserved: frozenset[str] = frozenset()

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        resource = request.resource
        if resource is not None and self.unserved:
            path = "/".join(part for part in (resource.group, resource.version, resource.plural) if part)
            if path in self.unserved:
                return aiohttp.web.json_response(NOT_FOUND, status=404)
        content_type = request.headers.get("Content-Type", "")
        if (
            request.resource is not None
            and request.method == kmock.method.PATCH
            and content_type.startswith(APPLY_PATCH)
            and request.name is not None
            and not request.subresource
        ):
            key: Any = (request.resource, request.namespace, request.name)
            async with self._lock:
                if key not in self._objects or self._objects[key].deleted:
                    if key in self._objects:
                        self._objects[key].create(request.data)
                    else:
                        self._objects[key] = request.data
                    raw = self._objects[key].last.raw
                    await self._buses[request.resource].put({"type": "ADDED", "object": raw})
        return await super()._handle(request)
