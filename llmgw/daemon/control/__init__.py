"""The control plane (plane.py), the agents' sessions with it (agent_sessions.py), its store
(store.py) and the admin API's HTTP shell (admin_server.py)."""
