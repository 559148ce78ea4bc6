"""What the engine side and the worker side (and a run) share, importing neither.

``slot_ring`` (the host slots the engine owns and the worker fills) and ``shm_records`` (the
operating system's side of shared memory: what a run records in ``/dev/shm`` while it lives, and
the reclaiming of dead runs' segments). Like :mod:`speculators_v016.protocol`, this package
imports nothing of ``engine``, ``worker``, ``run`` or ``store``.
"""
