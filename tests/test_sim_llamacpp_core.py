"""The llama.cpp simulator's pure core: slot choice, prompt reuse, deferral, the LoRA quirk, limits."""

from __future__ import annotations

import random

from llmgw.sim.llamacpp_core import LlamaConfig, LlamaCore, LlamaRequest, LoraAdapter, Output, common_prefix
from llmgw.sim.tokenizer import Tokenizer

TOK = Tokenizer(bos_id=0, eos_id=2)


def make(n_slots: int = 2, n_ctx: int = 512, adapters: list[LoraAdapter] | None = None, **kw: object) -> LlamaCore:
    return LlamaCore(LlamaConfig(n_slots=n_slots, n_ctx=n_ctx, **kw), TOK, adapters)  # type: ignore[arg-type]


def prompt(n: int, base: int = 1000) -> list[int]:
    return [0] + [base + i for i in range(n - 1)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


def step(core: LlamaCore, clock: Clock) -> list[Output]:
    plan = core.schedule(clock.now)
    assert plan is not None
    clock.now += plan.duration
    return core.complete(plan, clock.now)


def run_all(core: LlamaCore, clock: Clock | None = None, limit: int = 10_000) -> list[Output]:
    clock = clock or Clock()
    outs: list[Output] = []
    for _ in range(limit):
        if not core.has_work():
            return outs
        outs += step(core, clock)
    raise AssertionError("core did not drain")


def req(rid: str, p: list[int], n_predict: int = 4, **kw: object) -> LlamaRequest:
    return LlamaRequest(rid, p, n_predict=n_predict, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_common_prefix_matches_a_plain_scan() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(8))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n == common_prefix(b, a)


def test_first_request_takes_lru_slot_ties_to_last() -> None:
    core = make()
    r = req("a", prompt(20))
    core.add_request(r, 0.0)
    run_all(core)
    # all slots unused (t_last_used -1): llama.cpp's `<=` scan ends on the last one
    assert r.slot == 1 and r.n_cached == 0 and r.n_processed == 20 and r.stop_type == "limit"


def test_lcp_slot_choice_and_reuse_counts() -> None:
    core, clock = make(), Clock()
    a, b = req("a", prompt(100, 1000)), req("b", prompt(100, 5000))
    core.add_request(a, 0.0)
    core.add_request(b, 0.0)
    run_all(core, clock)
    assert {a.slot, b.slot} == {0, 1}
    # 100-token prompt + 4 generated, the last of which never entered the KV
    assert len(core.slots[a.slot].tokens) == 103
    c = req("c", prompt(100, 1000)[:90] + [7] * 30)
    core.add_request(c, clock.now)
    run_all(core, clock)
    assert c.slot == a.slot
    assert c.n_cached == 90 and c.n_processed == 30
    assert core.metrics.prompt_cached == 90
    assert core.metrics.prompt_tokens == 100 + 100 + 30


def test_identical_prompt_reevaluates_last_token() -> None:
    core, clock = make(n_slots=1), Clock()
    p = prompt(50)
    core.add_request(req("a", p, n_predict=1), 0.0)
    run_all(core, clock)
    b = req("b", p, n_predict=1)
    core.add_request(b, clock.now)
    run_all(core, clock)
    assert b.n_cached == 49 and b.n_processed == 1


def test_low_similarity_falls_back_to_lru() -> None:
    core, clock = make(), Clock()
    a = req("a", prompt(100, 1000))
    core.add_request(a, 0.0)
    run_all(core, clock)  # slot 1 used at t>0, slot 0 never used
    clock.now += 1
    # shares 5/100 tokens with slot 1: below the 0.1 threshold, so the LRU slot (0) wins
    b = req("b", prompt(100, 1000)[:5] + [9] * 95)
    core.add_request(b, clock.now)
    run_all(core, clock)
    assert a.slot == 1 and b.slot == 0 and b.n_cached == 0


def test_similarity_zero_disables_lcp_choice() -> None:
    core, clock = make(slot_prompt_similarity=0.0), Clock()
    a = req("a", prompt(100))
    core.add_request(a, 0.0)
    run_all(core, clock)
    clock.now += 1
    b = req("b", prompt(100))
    core.add_request(b, clock.now)
    run_all(core, clock)
    assert b.slot != a.slot and b.n_cached == 0


def test_cache_prompt_false_reuses_nothing() -> None:
    core, clock = make(n_slots=1), Clock()
    core.add_request(req("a", prompt(60)), 0.0)
    run_all(core, clock)
    b = req("b", prompt(60), cache_prompt=False)
    core.add_request(b, clock.now)
    run_all(core, clock)
    assert b.n_cached == 0 and b.n_processed == 60


def test_id_slot_pins_and_defers_when_busy() -> None:
    core, clock = make(), Clock()
    a = req("a", prompt(10), n_predict=50, id_slot=0)
    b = req("b", prompt(10, 3000), n_predict=2, id_slot=0)
    core.add_request(a, 0.0)
    core.add_request(b, 0.0)
    step(core, clock)  # launch
    assert a.slot == 0 and b.slot == -1 and core.requests_deferred == 1
    run_all(core, clock)
    assert b.slot == 0 and b.finished


def test_deferred_when_all_slots_busy_then_runs() -> None:
    core, clock = make(n_slots=2), Clock()
    rs = [req(f"r{i}", prompt(10, 1000 * (i + 1)), n_predict=3) for i in range(3)]
    for r in rs:
        core.add_request(r, 0.0)
    step(core, clock)
    assert core.requests_processing == 2 and core.requests_deferred == 1
    run_all(core, clock)
    assert all(r.finished for r in rs) and core.requests_deferred == 0


def test_abort_frees_slot_and_keeps_kv() -> None:
    core, clock = make(n_slots=1), Clock()
    a = req("a", prompt(30), n_predict=100)
    b = req("b", prompt(30, 7000), n_predict=1)
    core.add_request(a, 0.0)
    core.add_request(b, 0.0)
    for _ in range(4):
        step(core, clock)
    assert core.requests_deferred == 1
    assert core.abort("a", clock.now)
    assert core.requests_processing == 0
    assert len(core.slots[0].tokens) >= 30  # its KV stays for reuse
    run_all(core, clock)
    assert b.finished and b.slot == 0


def test_abort_deferred_request() -> None:
    core, clock = make(n_slots=1), Clock()
    core.add_request(req("a", prompt(10), n_predict=10), 0.0)
    core.add_request(req("b", prompt(10)), 0.0)
    step(core, clock)
    assert core.abort("b", clock.now) and core.requests_deferred == 0
    assert not core.abort("b", clock.now)


def test_context_overflow_is_a_slot_error() -> None:
    core, clock = make(n_slots=1, n_ctx=64), Clock()
    r = req("a", prompt(64))
    core.add_request(r, 0.0)
    outs = run_all(core, clock)
    assert r.error is not None and r.error[0] == "exceed_context_size_error"
    assert "request (64 tokens) exceeds the available context size (64 tokens)" in r.error[1]
    assert outs[-1].finished and core.requests_processing == 0


def test_generation_stops_at_slot_context() -> None:
    core = make(n_slots=1, n_ctx=40)
    r = req("a", prompt(30), n_predict=-1)
    core.add_request(r, 0.0)
    run_all(core)
    assert r.stop_type == "limit" and 30 + r.n_gen - 1 + 1 >= 40 and r.n_gen == 10


def test_eos_and_n_predict_zero() -> None:
    core = make(n_slots=1, default_output_len=8)
    r = LlamaRequest("a", prompt(10), n_predict=-1)
    core.add_request(r, 0.0)
    run_all(core)
    assert r.stop_type == "eos" and r.output[-1] == TOK.eos_id
    z = LlamaRequest("z", prompt(12), n_predict=0)
    core.add_request(z, 0.0)
    run_all(core)
    assert z.n_gen == 0 and z.stop_type == "limit" and z.n_processed > 0


def _lora_core() -> tuple[LlamaCore, Clock]:
    return make(n_slots=1, adapters=[LoraAdapter(0, "a.gguf", 1.0)]), Clock()


def test_lora_list_change_clears_slot() -> None:
    core, clock = _lora_core()
    p = prompt(80)
    core.add_request(req("a", p, lora={0: 0.0}), 0.0)
    run_all(core, clock)
    b = req("b", p, lora={0: 1.0})
    core.add_request(b, clock.now)
    run_all(core, clock)
    assert b.n_cached == 0  # differing explicit list: KV cleared
    c = req("c", p, lora={0: 1.0})
    core.add_request(c, clock.now)
    run_all(core, clock)
    assert c.n_cached == 79  # same list: reused


def test_request_without_lora_keeps_kv_of_other_adapter_setting() -> None:
    core, clock = _lora_core()
    p = prompt(80)
    core.add_request(req("a", p, lora={0: 0.0}), 0.0)
    run_all(core, clock)
    b = req("b", p)  # no list: takes the global scale 1.0 but keeps the KV computed at 0.0 (the quirk)
    core.add_request(b, clock.now)
    run_all(core, clock)
    assert b.n_cached == 79 and core.slots[0].lora == (1.0,)
    # an explicit list equal to the slot's (global) vector does not clear either
    c = req("c", p, lora={0: 1.0})
    core.add_request(c, clock.now)
    run_all(core, clock)
    assert c.n_cached == 79


def test_unknown_lora_id_is_ignored_and_global_scale_change_keeps_kv() -> None:
    core, clock = _lora_core()
    p = prompt(40)
    core.add_request(req("a", p), 0.0)
    run_all(core, clock)
    core.set_global_scales({0: 0.5})
    b = req("b", p)
    core.add_request(b, clock.now)
    run_all(core, clock)
    assert b.n_cached == 39  # a global scale change does not clear the KV
    d = req("d", p, lora={7: 1.0, 0: 0.5})
    core.add_request(d, clock.now)
    run_all(core, clock)
    assert d.n_cached == 39 and core.slots[0].lora == (0.5,)


def test_cost_model_and_metrics() -> None:
    core = make(n_slots=2, prefill_s_per_token=0.001, decode_s_per_step=0.01)
    clock = Clock()
    a = req("a", prompt(100), n_predict=3)
    core.add_request(a, 0.0)
    run_all(core, clock)
    # 100 prompt tokens at 1 ms + two decode steps at 10 ms (the first token is free)
    assert abs(clock.now - (0.1 + 0.02)) < 1e-9
    t = a.timings()
    assert t["prompt_n"] == 100 and abs(float(t["prompt_ms"]) - 100.0) < 1e-6
    assert t["predicted_n"] == 3 and abs(float(t["predicted_ms"]) - 20.0) < 1e-6
    m = core.metrics
    assert m.prompt_tokens == 100 and m.predicted_tokens == 3 and m.predicted_steps == 2
    assert m.n_decode == 3 and m.n_busy_slots == 3 and m.n_tokens_max == 102


def test_lora_settings_are_not_batched_together() -> None:
    core = make(n_slots=2, adapters=[LoraAdapter(0, "a.gguf", 0.0)])
    a = req("a", prompt(10), lora={0: 1.0})
    b = req("b", prompt(10, 4000), lora={0: 0.0})
    core.add_request(a, 0.0)
    core.add_request(b, 0.0)
    clock = Clock()
    step(core, clock)  # launch both
    plan = core.schedule(clock.now)
    assert plan is not None and len(plan.prefill) == 1


# -- the host-RAM prompt cache (--cache-ram) -------------------------------------------------------
def test_prompt_cache_brings_back_a_displaced_prompt() -> None:
    core, clock = make(n_slots=1, cache_ram_mib=100, kv_bytes_per_token=256), Clock()
    a, b = prompt(300, 1000), prompt(300, 5000)
    for rid, p in (("a", a), ("b", b)):
        core.add_request(req(rid, p, n_predict=2), clock.now)
        run_all(core, clock)
    assert core.cache is not None and [t[:300] for t in core.cache.states] == [a]
    again = req("a2", a + [7, 7])
    core.add_request(again, clock.now)
    run_all(core, clock)
    assert again.n_cached == 300  # all of a, restored from host RAM
    assert [t[:300] for t in core.cache.states] == [b]  # loading takes an entry out; b went in


def test_prompt_cache_disabled_and_byte_limit() -> None:
    core, clock = make(n_slots=1), Clock()  # cache_ram_mib=0
    assert core.cache is None
    small = make(n_slots=1, cache_ram_mib=1, kv_bytes_per_token=4096)  # 1 MiB = 256 tokens
    assert small.cache is not None
    assert not small.cache.save(prompt(300))  # larger than the whole cache: skipped
    assert small.cache.save(prompt(200, 1000)) and small.cache.save(prompt(200, 2000))
    assert [t[1] for t in small.cache.states] == [2000]  # the oldest made room


def test_prompt_cache_save_skips_contained_and_drops_prefixes() -> None:
    core = make(cache_ram_mib=100, kv_bytes_per_token=256)
    c = core.cache
    assert c is not None
    p = prompt(100)
    assert c.save(p[:50]) and c.save(p)
    assert c.states == [p]  # the shorter prefix entry is obsolete
    assert not c.save(p[:80])  # already contained whole
    assert not c.save([])


def test_prompt_cache_load_rules() -> None:
    core = make(cache_ram_mib=100, kv_bytes_per_token=256)
    c = core.cache
    assert c is not None
    long = prompt(400)
    c.save(long)
    # keeping only 50/400 of the entry (< 1/4) would trash it: not loaded
    assert c.load([], long[:50] + [9] * 10) is None
    # keeping 200/400 and matching most of the new prompt: loaded (and taken out)
    assert c.load([], long[:200] + [9] * 10) == long and c.states == []


def test_prompt_cache_no_byte_limit_still_has_a_token_limit() -> None:
    core = make(cache_ram_mib=-1, cache_tokens=500)  # --cache-ram -1: limited to n_ctx tokens
    c = core.cache
    assert c is not None
    c.save(prompt(300, 1000))
    c.save(prompt(300, 2000))
    c.update()
    assert [t[1] for t in c.states] == [2000]


def test_idle_slots_are_mirrored_into_the_cache() -> None:
    core, clock = make(n_slots=2, cache_ram_mib=100, kv_bytes_per_token=256), Clock()
    a = req("a", prompt(50, 1000), n_predict=2)
    core.add_request(a, 0.0)
    run_all(core, clock)
    b = req("b", prompt(50, 3000), n_predict=2)
    core.add_request(b, clock.now)
    step(core, clock)  # b's launch saves the idle slot that holds a
    assert core.cache is not None and any(t[:50] == a.prompt for t in core.cache.states)
