"""Inference from Python: search (greedy, beam, sampling), translator, generator, classifier,
attention maps."""
