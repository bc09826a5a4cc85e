"""What the admin API's two clients, `llmgw ctl` and `llmgw console`, share: which daemon to talk
to and how (target: flags, environment, config file, default socket, in that order), and a routing
decision's rationale, a trace and the facility laid out as text (rationale, trace_view, facility).
No Textual here, and no HTTP: each command keeps its own client (ctl's in llmgw/cli/ctl/main.py,
the console's in llmgw/tui/client.py)."""
