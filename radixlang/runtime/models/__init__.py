"""Native model implementations (the Llama family) over the paged KV cache.

Part of the runtime: they may import ``radixlang.kernels`` and the runtime's KV cache and
forward batch, never the language or the server.
"""
