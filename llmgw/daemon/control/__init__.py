"""The control plane: the agents' sessions, reconciliation, the store and the admin API's HTTP shell."""
