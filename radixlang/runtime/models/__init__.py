"""Native model implementations over the paged KV cache."""
