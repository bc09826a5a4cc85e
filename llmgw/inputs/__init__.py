"""Bounds on untrusted input, below every other part of llmgw (it imports none of them): how much
of a client's input an error message quotes (:mod:`.echo`) and how deep structured input — admin
bodies, config files, eval suites, ``--set`` values — may nest before a recursive parser sees it
(:mod:`.nesting`). Pure: the config, the core and the shell all use it."""
