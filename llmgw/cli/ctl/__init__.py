"""`llmgw ctl`: the operator's command line over the admin API. main builds the parser and runs a
command; one module per command group (routing, lifecycle; the fleet's commands are main's own);
views lays the admin API's answers out as text; output holds the plain output functions."""
