"""The agent: one per node; its session with the router (agent.py) and the engine processes it
supervises (engines.py), with their log files (engine_logs.py) and the /proc and port helpers
(processes.py)."""
