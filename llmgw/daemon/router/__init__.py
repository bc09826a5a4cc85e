"""The router's request path: the OpenAI proxy, the replica registry and its scraping, the router's metrics."""
