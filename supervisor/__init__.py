"""vllm-supervisor: a daemon that owns one vLLM engine and keeps it serving."""

__version__ = "0.1.0"
