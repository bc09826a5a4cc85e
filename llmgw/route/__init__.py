"""The router's pure core: endpoint state, the filter → score → pick scheduler, the circuit
breaker, admission and the engines' metric contracts. No I/O and no trio here."""
