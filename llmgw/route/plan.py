"""One request's routing state across its attempts (:class:`Plan`): what RouterCore.plan builds
and next / finish carry forward — the request as the scorers see it, its model and strategy,
what it tried and how the last try failed, its place in a wait, its trace. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .adapters import Load
from .admission import Ticket
from .breaker import FailureKind
from .replicas import ModelEntry, Replica
from .strategies import Strategy
from .trace import Trace
from .types import Decision, RequestInfo, TenantTag

__all__ = ["Plan"]


@dataclass(slots=True, eq=False)
class Plan:
    """One request's routing state across its attempts."""

    info: RequestInfo
    entry: ModelEntry
    strategy: Strategy
    stream: bool
    started: float  # monotonic
    tried: set[str] = field(default_factory=set)
    attempts: int = 0
    admitted: bool = False
    ticket: Ticket | None = None  # its place in the wait queue while it waits
    failure: FailureKind | None = None  # how the last attempt failed
    detail: str = ""  # ... in words (for a timeout: the phase)
    # A replica that answered this request 5xx, its breaker verdict held back: if another
    # replica answers 5xx too, the request is the fault (poison) and neither breaker counts it.
    suspect: Replica | None = None
    # May the shell drop an engine's 5xx answer and ask for another attempt? False once a
    # replica answered 5xx (the next 5xx is the engine's word, relayed) or on the last attempt.
    retry_5xx: bool = True
    counted: bool = False  # its one llmgw_requests_total increment is done (RouterCore._done)
    body: dict[str, Any] | None = None  # the parsed request (tier 2's step reads it)
    raw: bytes = b""  # the request's body as it came (what an attempt sends: Attempt.body)
    load: Load | None = None  # the adapter load it waits on (adapter_routing.py)
    adapter_wait: bool = False  # its ticket waits for an adapter slot, not for the model's admission
    wait_reason: str = ""  # ... and why (the 429's message if its deadline passes)
    adapter_missing: bool = False  # a holder answered 404 for its adapter once (retried; a second is relayed)
    trace: Trace | None = None  # its phases, attempts and outcome (llmgw.route.trace)
    internal: bool = False  # the eval runner's: not client traffic (not in the canary's tally)
    tier2: bool = False  # tier 2's step (its prompt's KV block hashes) is still to do (tier2.py)
    tier2_started: float | None = None  # ... began then (Tier2's clock)
    tenant: TenantTag | None = None  # who sent it (admission's band and share); None: the anonymous tenant
    share: float = 1.0  # its tenant's share of its band when it was let through (1.0: it did not wait)
    cold: bool = False  # it waits (or waited) for a cold start: its model had no replica (WaitRoom.cold)
    # prefill/decode disaggregation (pd.py, pd_step.py): the step to come — "prefill", "decode"
    # (to a decode or both replica), "" (the model is not disaggregated)
    pd: str = ""
    kv_params: dict[str, Any] | None = None  # the prefiller's kv_transfer_params, for the decoder
    prefilled_on: str = ""  # the prefiller that holds them
    pd_blocks: int = 0  # ... how many blocks
    prefills: int = 0  # prefill attempts made (a connect failure tries another prefiller; any other falls back)
    # the decoder's decision made with the prefill step's cache check (pd_step.py): the decode
    # loop takes it as its first decision instead of deciding again
    predecided: Decision | None = None

    @property
    def model(self) -> str:
        return self.entry.name
