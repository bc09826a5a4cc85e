"""The agents' side of the control plane: their sessions, node identities, the control TLS, report checks."""
