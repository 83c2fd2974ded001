"""radixlang: a Python language and local runtime for LLM programs."""

__version__ = "0.1.0"
