"""The training engine: the step, the loop, evaluation, optimizers, sharding, several hosts,
transfer, metric writing."""
