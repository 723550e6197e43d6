"""The compressing cache: the radix tree, per-request state, the compressor and its engines."""
