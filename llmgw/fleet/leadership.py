"""Who leads the control plane among several routers: the lease as one router keeps it (pure).

Routers share one store; its `leader` row is a lease: a holder, an epoch and an expiry on the
store's clock (the store's `try_lead` takes or renews it in one transaction: docs/ha.md). Each
router asks every `lease_s / 3`; a `LeaseKeeper` turns the answers — and the silences, when the
store cannot be reached — into what the router does:

- the row is ours → lead with its epoch (`Lead`), or go on leading;
- the row is another router's → follow (`StepDown` if we led);
- no renewal has succeeded for `lease_s` since the start of the last one that did → step down:
  the store may already have given the lease to another router, so this one must stop acting
  before that can happen. The deadline is counted from the moment the successful request was
  *sent* (our monotonic clock), never from when its answer arrived, so it always falls before
  the store's own expiry of that lease.

`leading(now)` is the one test every act of the leader passes first (a reconcile, a desired set
sent to an agent, an admin write): a router paused past its lease (SIGSTOP, a frozen VM) wakes
with `now` beyond the deadline and does nothing before its next renewal tells it where it
stands. What it might still write is refused by the store's fence (the epoch), and what it might
still send an agent is refused by the agent (an older epoch than one it has seen)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lead", "LeaseKeeper", "LeaseView", "StepDown"]


@dataclass(frozen=True, slots=True)
class LeaseView:
    """The store's answer to `try_lead`, as far as the keeper needs it."""
    holder: str
    epoch: int
    mine: bool


@dataclass(frozen=True, slots=True)
class Lead:
    epoch: int


@dataclass(frozen=True, slots=True)
class StepDown:
    reason: str


class LeaseKeeper:
    """One router's view of the lease. Feed it `renewed` (an answer, with the monotonic time its
    request was sent) or `unreachable` (a request failed); each answers what changes, or None."""

    def __init__(self, router_id: str, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        self.router_id = router_id
        self.lease_s = lease_s
        self.epoch = 0  # ours while we lead; the last seen otherwise
        self.holder: str | None = None  # the leader as last seen ("" or None: nobody known)
        self._leading = False
        self._deadline = float("-inf")
        self.changes = 0  # how many times this router took or lost the lead

    @property
    def interval_s(self) -> float:
        """How often to ask the store: three tries fit in one lease."""
        return self.lease_s / 3

    def leading(self, now: float) -> bool:
        return self._leading and now < self._deadline

    def renewed(self, view: LeaseView, sent_at: float) -> Lead | StepDown | None:
        self.holder = view.holder
        if view.mine:
            was = self._leading and self.epoch == view.epoch
            self._deadline = sent_at + self.lease_s
            self.epoch = view.epoch
            if was:
                return None
            self._leading = True
            self.changes += 1
            return Lead(view.epoch)
        self.epoch = view.epoch
        return self._lose(f"router {view.holder} leads (epoch {view.epoch})")

    def unreachable(self, now: float) -> StepDown | None:
        """A renewal failed. The lease is kept while it lasts; past it, step down."""
        if self._leading and now >= self._deadline:
            return self._lose(f"the lease could not be renewed for {self.lease_s:g}s (the store is unreachable)")
        return None

    def fenced(self) -> StepDown | None:
        """The store refused a write stamped with our epoch: another router leads now."""
        return self._lose("the store refused a write of this router's epoch (another router took the lead)")

    def resign(self, reason: str) -> StepDown | None:
        """This router gives the lead up of its own accord (it hears no agent: daemon/control/leader.py)."""
        return self._lose(reason)

    def expired(self, now: float) -> StepDown | None:
        """Checked before acting: a router that slept past its deadline steps down at once."""
        if self._leading and now >= self._deadline:
            return self._lose(f"the lease ran out ({self.lease_s:g}s) before it was renewed")
        return None

    def _lose(self, reason: str) -> StepDown | None:
        if not self._leading:
            return None
        self._leading = False
        self._deadline = float("-inf")
        self.changes += 1
        return StepDown(reason)
