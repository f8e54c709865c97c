"""Tensor parallelism over torch.distributed (docs/tensor-parallel.md).

- :mod:`engine.parallel.group` — the process group (NCCL on GPU, gloo on CPU; a gloo CPU group for control).
- :mod:`engine.parallel.shard` — the split of a model (:func:`plan_shards`) and a rank's :class:`TPModel`.
- :mod:`engine.parallel.loader` — each rank reads only its slices of the safetensors tensors.
- :mod:`engine.parallel.wire` — rank 0's control messages and step diffs, msgpack over a broadcast.
- :mod:`engine.parallel.engine` — :class:`TPEngineCore` (rank 0) and :class:`Follower` (ranks > 0).
- :mod:`engine.parallel.follower` — the follower process entry and :func:`spawn_followers`.

Import the submodules directly; this package imports nothing heavy itself.
"""
