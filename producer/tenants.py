"""Tenants: the wall between API keys (or apps) that share one fleet, as one rule for every entry point.

A tenant's agent ids are qualified (`t:<tenant>:<id>`) before they reach Redis or a worker, so all
that is keyed by agent id (the KV cache, the conversation record, the turn lock and fence, the hot
worker) is the tenant's own; its jobs' `namespace` is the tenant, so anonymous prefix reuse (the store's
shared blocks, the worker's recent prefixes) never crosses tenants either. What goes back to a client
(a result's agent id, an error's text) is unqualified again: a client sees only its own ids.

Without a tenant nothing is qualified: a single app keeps today's agent ids, namespace and reuse.
Tenant names have the shape of a namespace (no ':'), so a qualified id names exactly one tenant.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from producer.models import NAMESPACE_PATTERN, GenerationRequest, GenerationResult
from producer.wire.ids import MAX_AGENT_ID_LENGTH, agent_id_problem

QUALIFIER = "t:"
_TENANT = re.compile(NAMESPACE_PATTERN)


def tenant_problem(name: object) -> str | None:
    """Why `name` is not a valid tenant name, or None when it is."""
    if not isinstance(name, str) or _TENANT.fullmatch(name) is None:
        return f"tenant {name!r} must be 1 to 64 letters, digits and . _ - (starting with a letter or digit)"
    return None


def key_tenant(key: str) -> str:
    """The tenant of an API key no operator named: the key's SHA-256 (hex), never the key itself. It is
    also what Responses records were scoped by before tenants, so those stay readable."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str

    def __post_init__(self) -> None:
        if (problem := tenant_problem(self.name)) is not None:
            raise ValueError(problem)

    @property
    def prefix(self) -> str:
        return f"{QUALIFIER}{self.name}:"

    @property
    def max_agent_id(self) -> int:
        """The longest agent id a client of this tenant may name (its qualified form must fit)."""
        return MAX_AGENT_ID_LENGTH - len(self.prefix)

    def agent(self, agent_id: str) -> str:
        """The tenant's qualified form of a client's agent id (ValueError, naming only the client's id,
        when it is invalid or too long to qualify)."""
        if (problem := agent_id_problem(agent_id)) is not None:
            raise ValueError(problem)
        if len(agent_id) > self.max_agent_id:
            raise ValueError(f"agent id must be 1 to {self.max_agent_id} characters, got {len(agent_id)}")
        return self.prefix + agent_id

    def own(self, qualified: str) -> str | None:
        """The client's id of one of this tenant's qualified agent ids; None for anyone else's."""
        return qualified[len(self.prefix) :] if qualified.startswith(self.prefix) else None

    def unqualified(self, text: str) -> str:
        """`text` (an error, a log line for the client) with this tenant's qualified ids unqualified."""
        return text.replace(self.prefix, "")

    def request(self, request: GenerationRequest) -> GenerationRequest:
        """A client's validated request for this tenant: agent_id and fork_from qualified, `namespace`
        forced to the tenant (a client can neither widen nor leave it)."""
        update: dict[str, Any] = {"namespace": self.name}
        if request.agent_id is not None:
            update["agent_id"] = self.agent(request.agent_id)
        if request.fork_from is not None:
            update["fork_from"] = self.agent(request.fork_from)
        return request.model_copy(update=update)

    def result(self, result: GenerationResult) -> GenerationResult:
        """A job's result as the client sees it: its agent id unqualified."""
        if result.agent_id is None:
            return result
        return result.model_copy(update={"agent_id": self.unqualified(result.agent_id)})


def tenant_of(name: str | Tenant | None) -> Tenant | None:
    """A Tenant from a name (None: no tenant, nothing qualified)."""
    return name if isinstance(name, Tenant) or name is None else Tenant(name)
