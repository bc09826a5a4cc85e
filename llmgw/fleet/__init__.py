"""The fleet's pure core: the agent ↔ router wire format, node states, placement, reconciliation
and engine restart policy. No I/O and no trio here: the trio shell in llmgw.daemon drives it."""
