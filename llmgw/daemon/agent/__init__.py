"""The agent: one per node; its session with the router and the engine processes it supervises."""
