"""``GET /v1/models`` and ``GET /v1/models/{id}``: OpenAI's model objects — each model the router
serves, then its LoRA adapters (``parent`` names the base) — as far as the caller's key may use
them (a tenant's or key's model list, docs/tenants.md). Candidate revisions are never listed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from llmgw.config.names import is_candidate_key
from llmgw.inputs.echo import echo
from llmgw.route.openai_req import ApiError
from llmgw.tenants import Principal

if TYPE_CHECKING:
    from llmgw.daemon.router.registry import Registry
    from llmgw.daemon.router.tenancy import Tenancy

__all__ = ["ModelList"]


class ModelList:
    def __init__(self, registry: Registry, tenancy: Tenancy, principal: Principal | None) -> None:
        self.registry = registry
        self.tenancy = tenancy
        self.principal = principal  # None: llmgw's own eval runner (everything)

    def objects(self) -> Iterable[dict[str, Any]]:
        p = self.principal
        created = int(time.time())
        allowed = self.tenancy.allows if p is not None and p.models is not None else None
        for m in self.registry.models.values():
            if is_candidate_key(m.name):
                continue
            if allowed is None or allowed(p, m.name, None):  # type: ignore[arg-type]
                yield {"id": m.name, "object": "model", "created": created, "owned_by": "llmgw",
                       "root": m.name, "parent": None, "replicas": len(m.replicas)}
            for a in sorted({*m.adapters, *m.declared}):  # declared ones, and what replicas list
                if allowed is None or allowed(p, a, m.name):  # type: ignore[arg-type]
                    yield {"id": a, "object": "model", "created": created, "owned_by": "llmgw",
                           "root": a, "parent": m.name, "replicas": len(m.adapters.get(a, ()))}

    def all(self) -> bytes:
        return json.dumps({"object": "list", "data": list(self.objects())}).encode()

    def one(self, quoted: str) -> bytes:
        """One model object, or OpenAI's 404. The id is percent-decoded (a model name may hold a
        slash: ``org/name``); a model the key may not use is as absent as one that does not exist."""
        name = unquote(quoted)
        for obj in self.objects():
            if obj["id"] == name:
                return json.dumps(obj).encode()
        raise ApiError(404, f"The model {echo(name, quote='`')} does not exist.", param="model",
                       code="model_not_found")
