"""The model lifecycle in the control plane: revisions and jobs, eval suites and their runs, auto-promote."""
