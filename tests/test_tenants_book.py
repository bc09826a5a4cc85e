"""The tenant book: an Authorization header to a principal, or 401/403 in OpenAI's envelope."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.tenants import AuthRefused, Principal, TenantBook
from llmgw.tenants.keys import new_key, visible_prefix
from llmgw.tenants.model import ApiKey, Tenant

NOW = 1_800_000_000.0


def _key(tenant: str, seed: int, **kw: object) -> tuple[str, ApiKey]:
    rng = random.Random(seed)
    secret, kid, h = new_key(lambda n: bytes(rng.getrandbits(8) for _ in range(n)))
    return secret, ApiKey(id=kid, tenant=tenant, hash=h, prefix=visible_prefix(kid), **kw)  # type: ignore[arg-type]


def _book(**kw: object) -> tuple[TenantBook, dict[str, str]]:
    tenants = [Tenant("team-a", band="high", weight=2.0, models=("llama", "qwen")), Tenant("team-b")]
    secrets: dict[str, str] = {}
    keys = []
    for name, tenant, extra in (("a", "team-a", {}), ("a-narrow", "team-a", {"models": ("qwen", "mistral")}),
                                ("b", "team-b", {"band": "batch"}), ("revoked", "team-b", {"revoked_at": NOW - 5}),
                                ("expired", "team-b", {"expires_at": 1_790_000_000.0}),
                                ("later", "team-b", {"expires_at": NOW + 60}), ("orphan", "gone", {})):
        s, k = _key(tenant, len(keys), **extra)
        secrets[name] = s
        keys.append(k)
    return TenantBook(tenants, keys, **kw), secrets  # type: ignore[arg-type]


def _refusal(book: TenantBook, header: str | None) -> AuthRefused:
    with pytest.raises(AuthRefused) as e:
        book.authenticate(header, NOW)
    return e.value


def test_a_key_maps_to_its_tenant_band_weight_and_models() -> None:
    book, s = _book()
    p = book.authenticate(f"Bearer {s['a']}", NOW)
    assert (p.tenant.name, p.band, p.weight, p.models) == ("team-a", "high", 2.0, ("llama", "qwen"))
    assert p.key is not None and p.key_id == p.key.id
    narrow = book.authenticate(f"bearer {s['a-narrow']}", NOW)  # the scheme in any case
    assert narrow.models == ("qwen",)  # both lists must allow
    b = book.authenticate(f"BEARER  {s['b']} ", NOW)
    assert (b.tenant.name, b.band, b.models) == ("team-b", "batch", None)  # the key's band wins
    assert book.authenticate(f"Bearer {s['later']}", NOW).tenant.name == "team-b"
    assert not book.open


@pytest.mark.parametrize(("header", "message"), [
    (None, "Invalid or missing API key."),
    ("", "Invalid or missing API key."),
    ("Basic abc", "Invalid or missing API key."),
    ("Bearer ", "Invalid or missing API key."),
    ("Bearer sk-nope", "Invalid or missing API key."),
])
def test_missing_or_unknown_keys_are_401(header: str | None, message: str) -> None:
    book, _ = _book()
    e = _refusal(book, header)
    assert (e.status, e.code, e.message) == (401, "invalid_api_key", message)
    assert e.body() == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                  "code": "invalid_api_key"}}


def test_revoked_expired_and_orphaned_keys_are_401_with_why_and_never_the_secret() -> None:
    book, s = _book()
    cases = {"revoked": "This API key has been revoked.",
             "expired": "This API key expired at 2026-09-21T14:13:20Z.",
             "orphan": "This API key's tenant no longer exists."}
    for name, message in cases.items():
        e = _refusal(book, f"Bearer {s[name]}")
        assert (e.status, e.message) == (401, message)
        assert s[name] not in str(e.body())
    # a key expiring later is fine until then, refused from then on
    assert _refusal(TenantBook([Tenant("team-b")], [_key("team-b", 3, expires_at=NOW)[1]]),
                    f"Bearer {_key('team-b', 3)[0]}").message.startswith("This API key expired at")


def test_a_right_id_with_a_wrong_secret_is_unknown() -> None:
    book, s = _book()
    forged = s["a"][:-4] + ("0000" if not s["a"].endswith("0000") else "1111")
    assert _refusal(book, f"Bearer {forged}").message == "Invalid or missing API key."


def test_static_keys_are_the_static_tenant_in_the_static_band() -> None:
    book, s = _book(static_keys=["plain-secret", "other"], static_tenant="ops", static_band="critical")
    p = book.authenticate("Bearer plain-secret", NOW)
    assert (p.tenant.name, p.tenant.static, p.band, p.key, p.key_id) == ("ops", True, "critical", None, "static")
    assert book.authenticate(f"Bearer {s['a']}", NOW).tenant.name == "team-a"  # store keys still work
    assert _refusal(book, "Bearer plain-secreT").status == 401
    assert book.tenant("ops") is p.tenant and "ops" in book.tenants()
    only_static = TenantBook([], [], static_keys=["k"])
    assert not only_static.open and only_static.authenticate("Bearer k", NOW).tenant.name == "static"


def test_an_open_book_takes_every_request_as_the_anonymous_tenants() -> None:
    book = TenantBook([Tenant("team-a")], [], anonymous_tenant="anon")
    assert book.open
    for header in (None, "Bearer whatever", "junk"):
        p = book.authenticate(header, NOW)
        assert (p.tenant.name, p.key_id, p.band) == ("anon", "-", "normal")
    # a stored tenant of the anonymous name gives its settings to anonymous requests
    named = TenantBook([Tenant("default", band="low", models=("m",))], [])
    assert named.authenticate(None, NOW).band == "low" and named.authenticate(None, NOW).models == ("m",)
    # revoked keys still count as keys: the book is not open
    _, revoked = _key("team-a", 9, revoked_at=NOW)
    assert not TenantBook([Tenant("team-a")], [revoked]).open


def test_allow_model_checks_both_lists_and_a_lora_base() -> None:
    book, s = _book()
    a = book.authenticate(f"Bearer {s['a']}", NOW)
    narrow = book.authenticate(f"Bearer {s['a-narrow']}", NOW)
    b = book.authenticate(f"Bearer {s['b']}", NOW)
    book.allow_model(a, "llama")
    book.allow_model(a, "llama-sql-lora", base="llama")  # the adapter's base is listed
    book.allow_model(b, "anything")  # no list
    book.allow_model(narrow, "qwen")
    for p, model, who in ((a, "mistral", "Tenant `team-a`"), (narrow, "llama", "This API key"),
                          (narrow, "mistral", "Tenant `team-a`")):
        with pytest.raises(AuthRefused) as e:
            book.allow_model(p, model)
        assert (e.value.status, e.value.code, e.value.param) == (403, "model_not_allowed", "model")
        assert e.value.message == f"{who} may not use the model `{model}`."
    with pytest.raises(AuthRefused) as e:
        book.allow_model(a, "x" * 5000)
    assert len(e.value.message) < 200  # client input echoed bounded


def test_the_book_is_a_snapshot() -> None:
    book, _ = _book(generation=7)
    assert book.generation == 7
    book.tenants().clear()
    book.keys().clear()
    assert len(book.tenants()) == 2 and len(book.keys()) == 7
    assert book.tenant("team-a") is not None and book.tenant("nobody") is None
    assert isinstance(book.principal_of_key(next(iter(book.keys()))), Principal)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=120))
def test_any_header_is_a_principal_or_a_401(header: str) -> None:
    book, s = _book(static_keys=["static-one"])
    try:
        p = book.authenticate(header, NOW)
    except AuthRefused as e:
        assert e.status == 401 and e.code == "invalid_api_key"
        assert e.message == "Invalid or missing API key."  # never a word of what was sent
    else:
        assert p.tenant.name in ("static", "team-a", "team-b")
