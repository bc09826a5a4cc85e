"""The control plane itself (plane/plane.py): models, reconciliation, routing replicas; operator actions, views,
groups, the facility, config reloads."""
