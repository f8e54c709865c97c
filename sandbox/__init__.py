"""Confinement of the engine worker: see :mod:`sandbox.launch` (``confine``, ``confine_worker``)."""
