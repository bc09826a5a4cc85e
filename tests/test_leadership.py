"""The lease as one router keeps it (llmgw/fleet/leadership.py): pure, on an injected clock."""

from __future__ import annotations

import pytest

from llmgw.fleet.leadership import Lead, LeaseKeeper, LeaseView, StepDown


def test_takes_the_lease_and_keeps_it_while_renewed() -> None:
    k = LeaseKeeper("a", 6.0)
    assert k.interval_s == 2.0
    assert not k.leading(0.0)
    assert k.renewed(LeaseView("a", 3, True), sent_at=0.0) == Lead(3)
    assert k.leading(5.9) and not k.leading(6.0)
    assert k.renewed(LeaseView("a", 3, True), sent_at=2.0) is None  # a renewal changes nothing
    assert k.leading(7.9) and not k.leading(8.0)
    assert k.changes == 1


def test_the_deadline_counts_from_when_the_renewal_was_sent() -> None:
    k = LeaseKeeper("a", 6.0)
    k.renewed(LeaseView("a", 1, True), sent_at=0.0)
    # the answer took 5 s to arrive: the store's lease runs from (at the latest) when it was asked
    k.renewed(LeaseView("a", 1, True), sent_at=1.0)
    assert not k.leading(7.0)


def test_another_holder_means_step_down() -> None:
    k = LeaseKeeper("a", 6.0)
    k.renewed(LeaseView("a", 1, True), sent_at=0.0)
    sd = k.renewed(LeaseView("b", 2, False), sent_at=2.0)
    assert isinstance(sd, StepDown) and "router b leads (epoch 2)" in sd.reason
    assert not k.leading(2.1) and k.holder == "b" and k.epoch == 2
    assert k.renewed(LeaseView("b", 2, False), sent_at=4.0) is None  # following: nothing to do


def test_a_new_epoch_of_our_own_is_a_new_lead() -> None:
    k = LeaseKeeper("a", 6.0)
    k.renewed(LeaseView("a", 1, True), sent_at=0.0)
    assert k.renewed(LeaseView("a", 2, True), sent_at=2.0) == Lead(2)


def test_unreachable_store_keeps_the_lease_only_while_it_lasts() -> None:
    k = LeaseKeeper("a", 6.0)
    k.renewed(LeaseView("a", 1, True), sent_at=0.0)
    assert k.unreachable(3.0) is None and k.leading(3.0)
    sd = k.unreachable(6.0)
    assert isinstance(sd, StepDown) and "could not be renewed" in sd.reason
    assert k.unreachable(9.0) is None  # said once


def test_a_router_that_slept_past_its_lease_steps_down_before_acting() -> None:
    k = LeaseKeeper("a", 6.0)
    k.renewed(LeaseView("a", 1, True), sent_at=0.0)
    assert k.expired(5.0) is None
    sd = k.expired(60.0)  # SIGSTOP for a minute, then SIGCONT
    assert isinstance(sd, StepDown) and not k.leading(60.0)


def test_fenced_steps_down_once() -> None:
    k = LeaseKeeper("a", 6.0)
    assert k.fenced() is None  # not leading: nothing to do
    k.renewed(LeaseView("a", 1, True), sent_at=0.0)
    assert isinstance(k.fenced(), StepDown)
    assert k.fenced() is None
    assert k.changes == 2


def test_lease_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LeaseKeeper("a", 0)


def test_resign_gives_the_lead_up() -> None:
    k = LeaseKeeper("a", 6.0)
    k.renewed(LeaseView("a", 1, True), sent_at=0.0)
    sd = k.resign("it hears no agent")
    assert isinstance(sd, StepDown) and sd.reason == "it hears no agent" and not k.leading(1.0)
    assert k.resign("again") is None
