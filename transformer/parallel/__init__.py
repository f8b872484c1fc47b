"""The devices a run spans: the mesh, its axes and logical-axis rules (`sharding`), and the
other processes of a multi-host run (`distributed`).

This package sits below `ops`: the kernels that run in a `shard_map` over the mesh
(`ops/ring.py`, `ops/splash.py`, `ops/expert_parallel.py`) read the axis names from here, as
do the model's logical axes and the train step.
"""
