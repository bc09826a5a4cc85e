"""Model lifecycle as pure rules: revisions (live and candidate), eval suites and their checks,
eval results, and jobs (update, eval, promote, rollback) with their steps. No I/O, no clock
(times are passed in); the control plane (llmgw/daemon/control/lifecycle/) applies them."""
