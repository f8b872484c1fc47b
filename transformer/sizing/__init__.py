"""Sizing a run: FLOPs, the memory plan, the summary, TPU topologies."""
