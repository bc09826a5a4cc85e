"""What the agent stream's gate counts, and its Prometheus series (registered on the router's
registry, so they appear on its `/metrics`):

- ``llmgw_agent_hellos_refused_total{reason}``: wrong_token, wrong_credential, no_credential,
  revoked, already_connected, version, store, join_rate (a new node name over
  `control.new_nodes_per_minute`);
- ``llmgw_agent_connections_closed_before_hello_total{why}``: pending_cap (too many connections
  waiting for their hello), timeout, oversize, protocol, tls, closed;
- ``llmgw_agent_connections_pending``: connections waiting for their hello now;
- ``llmgw_agent_reports_rejected_total``: engine reports refused for their URL;
- ``llmgw_node_credentials_issued_total``, ``llmgw_nodes_revoked_total``.

Every label value is one of a fixed set: nothing an outsider sends becomes a label."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["StreamMetrics", "StreamStats"]


@dataclass
class StreamStats:
    refused: Counter[str] = field(default_factory=Counter)  # by Admission.kind (+ "version", "store")
    closed_before_hello: Counter[str] = field(default_factory=Counter)
    reports_rejected: int = 0
    pending: int = 0  # connections waiting for their hello


class StreamMetrics(Collector):
    """`sessions` is the router's AgentSessions (its `stats` and `identities`)."""

    def __init__(self, sessions: Any) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[Any]:
        st: StreamStats = self.sessions.stats
        ids = self.sessions.identities
        fam = CounterMetricFamily("llmgw_agent_hellos_refused", "Agent hellos refused, by reason", labels=["reason"])
        for reason, n in sorted(st.refused.items()):
            fam.add_metric([reason], n)
        yield fam
        fam = CounterMetricFamily("llmgw_agent_connections_closed_before_hello",
                                  "Agent-stream connections closed before an accepted hello, by why", labels=["why"])
        for why, n in sorted(st.closed_before_hello.items()):
            fam.add_metric([why], n)
        yield fam
        yield GaugeMetricFamily("llmgw_agent_connections_pending", "Agent-stream connections waiting for their hello",
                                value=st.pending)
        yield CounterMetricFamily("llmgw_agent_reports_rejected", "Engine reports refused for their URL",
                                  value=st.reports_rejected)
        yield CounterMetricFamily("llmgw_node_credentials_issued", "Node credentials issued", value=ids.issued)
        yield CounterMetricFamily("llmgw_nodes_revoked", "Node credentials revoked by an operator", value=ids.revoked)
