"""llmgw: an OpenAI-compatible gateway and fleet manager for self-hosted LLM inference."""

__version__ = "0.1.0"
