"""The Linen model: TransformerConfig, blocks, the Transformer, the Vision Transformer."""
