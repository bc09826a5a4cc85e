"""The fleet's pure core: the agent ↔ router wire format and the engine specs and reports it carries,
node states, placement, reconciliation, engine restart policy and the agent's engine records. No
I/O and no trio here: the trio shell in llmgw.daemon drives it."""
