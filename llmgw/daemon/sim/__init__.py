"""The simulators' servers (vLLM, llama.cpp) around the pure engines of llmgw.sim, and `llmgw sim`."""
