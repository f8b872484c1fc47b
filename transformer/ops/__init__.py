"""Pure array functions: attention and its kernels, masks, layers, KV-cache writes."""
