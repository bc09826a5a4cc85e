"""The tier-2 kv_cache scorer (pure): votes by the share of leading blocks each candidate holds,
and the decision's note names the tier that decided and why."""

from __future__ import annotations

import random

from llmgw.route.kv_scorer import KvCacheScorer
from llmgw.route.scheduler import Scheduler
from llmgw.route.strategies import PRESETS
from llmgw.route.types import EndpointView, RequestInfo


def _eps() -> list[EndpointView]:
    return [EndpointView(id=f"m/{i}", model="m", url=f"http://e{i}", running=0.0, waiting=0.0,
                         kv_usage=0.1, stale=False) for i in range(3)]


def _decide(scorer: KvCacheScorer, req: RequestInfo):  # type: ignore[no-untyped-def]
    s = Scheduler(scorers={"kv_cache": scorer})
    return s.decide(req, _eps(), PRESETS["chat"], now=0.0, wall=0.0, rng=random.Random(1))


def test_the_holder_of_the_most_leading_blocks_wins_and_the_note_says_tier_2() -> None:
    held = {"m/1": 3, "m/2": 12, "other/1": 16}
    d = _decide(KvCacheScorer(lambda h: held), RequestInfo("r", "m", "m", kv_hashes=tuple(range(16))))
    assert d.chosen == "m/2"
    assert "tier 2: 12/16 blocks on m/2" in d.note
    scores = {c.endpoint_id: c.scores["kv_cache"] for c in d.candidates}
    assert scores == {"m/0": 0.0, "m/1": 3 / 16, "m/2": 12 / 16}


def test_no_hashes_scores_zero_and_the_note_says_why() -> None:
    calls = []
    sc = KvCacheScorer(lambda h: calls.append(h) or {})
    d = _decide(sc, RequestInfo("r", "m", "m", kv_note="tokenize on m/0 timed out after 0.5 s"))
    assert calls == [] and {c.scores["kv_cache"] for c in d.candidates} == {0.0}
    assert "tier 2 unavailable: tokenize on m/0 timed out after 0.5 s; tier 1 decides" in d.note


def test_a_model_without_kv_events_is_untouched() -> None:
    d = _decide(KvCacheScorer(lambda h: {"m/1": 5}), RequestInfo("r", "m", "m"))
    assert "tier" not in d.note and {c.scores["kv_cache"] for c in d.candidates} == {0.0}


def test_no_holder_and_no_index_fall_back_to_tier_1() -> None:
    d = _decide(KvCacheScorer(lambda h: {}), RequestInfo("r", "m", "m", kv_hashes=(1, 2)))
    assert "no candidate holds the first of 2 blocks; tier 1 decides" in d.note
    d = _decide(KvCacheScorer(None), RequestInfo("r", "m", "m", kv_hashes=(1, 2)))
    assert "tier 2 unavailable: no tier-2 index" in d.note


def test_each_committed_decision_counts_once_by_outcome_with_the_blocks_matched() -> None:
    held = {"m/1": 3, "m/2": 12}
    sc = KvCacheScorer(lambda h: held)
    d = _decide(sc, RequestInfo("r", "m", "m", kv_hashes=tuple(range(16))))
    st = sc.stats
    assert st.outcomes["decided"] == 1 and sum(st.outcomes.values()) == 1
    assert st.matched_sum == 12 and sum(st.matched) == 1
    assert st.by_replica == {d.chosen: [0, 1]}
    _decide(sc, RequestInfo("r", "m", "m"))  # not a kv_events model: not counted
    assert sum(st.outcomes.values()) == 1


def test_fallback_outcomes_say_why_tier_1_decided() -> None:
    cases = [
        (KvCacheScorer(lambda h: {}), RequestInfo("r", "m", "m", kv_hashes=(1, 2)), "no_events"),
        (KvCacheScorer(lambda h: {"m/0": 0}), RequestInfo("r", "m", "m", kv_hashes=(1, 2)), "miss"),
        (KvCacheScorer(None), RequestInfo("r", "m", "m", kv_hashes=(1, 2)), "no_index"),
        (KvCacheScorer(lambda h: {}), RequestInfo("r", "m", "m", kv_hashes=()), "no_full_block"),
        (KvCacheScorer(lambda h: {}), RequestInfo("r", "m", "m", kv_note="tokenize on m/0 timed out after 0.5 s"),
         "timeout"),
        (KvCacheScorer(lambda h: {}), RequestInfo("r", "m", "m", kv_note="an adapter's LoRA id is the engine's own"),
         "lora"),
        (KvCacheScorer(lambda h: {}), RequestInfo("r", "m", "m", kv_note="tokenize on m/0 answered garbage"),
         "tokenize_failed"),
        (KvCacheScorer(lambda h: {}), RequestInfo("r", "m", "m", kv_note="no replica to tokenize with"),
         "no_replica"),
        (KvCacheScorer(lambda h: {}), RequestInfo("r", "m", "m",
                                                  kv_note="no chat messages or string prompt to tokenize"),
         "unsupported"),
    ]
    for sc, req, want in cases:
        d = _decide(sc, req)
        assert {k: v for k, v in sc.stats.outcomes.items() if v} == {want: 1}, (want, d.note)
        assert sc.stats.by_replica == {d.chosen: [1, 0]}


def test_a_miss_names_the_candidates_whose_parity_alarm_is_on() -> None:
    sc = KvCacheScorer(lambda h: {"m/0": 0, "m/1": 0}, alarmed=lambda rid: rid == "m/1")
    d = _decide(sc, RequestInfo("r", "m", "m", kv_hashes=(1, 2)))
    assert ("tier 2: no candidate holds the first of 2 blocks (parity alarm on m/1: its engine hashes "
            "differently, see `llmgw ctl kv`); tier 1 decides") in d.note
    d = _decide(KvCacheScorer(lambda h: {"m/0": 0}, alarmed=lambda rid: False),
                RequestInfo("r", "m", "m", kv_hashes=(1, 2)))
    assert "parity" not in d.note
