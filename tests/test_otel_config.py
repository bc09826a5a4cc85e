"""[router.traces] otlp_*: parsing and the errors naming the field (never a header's value), the
config reload's plan hiding the headers' values, and the traces URL."""

from __future__ import annotations

import pytest

from llmgw.config import ConfigError, parse_config
from llmgw.daemon.router.otel_export import otlp_url
from llmgw.lifecycle.config_diff import diff_config

BASE = '[[models]]\nname = "m"\nengine = "vllm"\n[[models.replicas]]\nurl = "http://127.0.0.1:1"\n'


def test_defaults_are_off() -> None:
    t = parse_config(BASE).router.traces
    assert (t.otlp_endpoint, t.otlp_headers, t.service_name) == ("", {}, "llmgw")


def test_the_keys_parse() -> None:
    t = parse_config(BASE + '[router.traces]\notlp_endpoint = "https://otel.example:4318/v1/traces"\n'
                            'otlp_headers = { authorization = "Bearer abc", "x-tenant" = "t1" }\n'
                            'service_name = "gw-eu"\n').router.traces
    assert t.otlp_endpoint == "https://otel.example:4318/v1/traces" and t.service_name == "gw-eu"
    assert t.otlp_headers == {"authorization": "Bearer abc", "x-tenant": "t1"}


@pytest.mark.parametrize("text, words", [
    ('otlp_endpoint = "grpc://collector:4317"', "router.traces.otlp_endpoint: not an http(s) URL"),
    ('otlp_headers = { "bad name" = "x" }', "router.traces.otlp_headers: not a valid HTTP header name"),
    ('otlp_headers = { authorization = "Bearer top\\nsecret" }',
     "router.traces.otlp_headers: the value of header 'authorization' is not a valid header value"),
    ('service_name = ""', "router.traces.service_name"),
])
def test_bad_values_name_the_field(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + "[router.traces]\n" + text + "\n")
    assert words in str(e.value)
    assert "secret" not in str(e.value)  # a header's value is never echoed


def test_a_reload_plan_shows_that_the_headers_changed_never_their_values() -> None:
    old = parse_config(BASE + '[router.traces]\notlp_headers = { authorization = "Bearer old-secret" }\n')
    new = parse_config(BASE + '[router.traces]\notlp_headers = { authorization = "Bearer new-secret" }\n'
                              'otlp_endpoint = "http://c:4318"\n')
    plan = diff_config(old, new, {"m": old.models[0]}, {"m": "config"}, overrides={}, candidates={}, serving={"m"},
                       engines_differ=lambda a, b: False)
    rows = {c.key: (c.old, c.new, c.action) for c in plan.changes if c.section == "router"}
    assert rows["traces.otlp_headers.authorization"] == ("(hidden)", "(hidden)", "restart")
    assert rows["traces.otlp_endpoint"] == ("", "http://c:4318", "restart")
    assert "secret" not in repr(plan.changes)


def test_the_traces_url() -> None:
    assert otlp_url("http://c:4318") == "http://c:4318/v1/traces"
    assert otlp_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert otlp_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


def test_every_trace_sink_sees_each_finished_trace() -> None:
    from llmgw.daemon.router.otel_export import trace_sink

    class Sink:
        def __init__(self) -> None:
            self.seen: list[object] = []

        def on_end(self, t: object) -> None:
            self.seen.append(t)

    a, b = Sink(), Sink()
    assert trace_sink(None, None) is None
    assert trace_sink(a, None) == a.on_end
    both = trace_sink(a, b)
    assert both is not None
    both("t1")  # type: ignore[arg-type]
    assert a.seen == ["t1"] and b.seen == ["t1"]
