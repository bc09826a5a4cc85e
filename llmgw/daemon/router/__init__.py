"""The router's request path as I/O (the decisions are llmgw.route.dispatch's): the OpenAI proxy,
the replica registry and its scrape loop, the router's Prometheus metrics, and the control port —
what the control plane and the admin API may do to the router."""
