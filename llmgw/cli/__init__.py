"""The `llmgw` command line: the entry point (entry), shell completion, `llmgw kv` (kv) and
`llmgw ctl` (ctl/). Shell side: nothing of the pure core imports it."""

from llmgw.cli.entry import main

__all__ = ["main"]
