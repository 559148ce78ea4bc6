"""Engine side: drives vLLM 0.16 step by step and turns captured rows into per-request states.

``core`` (the step loop), ``executor`` (vLLM's executor plus our capture RPC),
``assembly`` (rows -> requests, attributed twice), ``slot_ring`` (the host
slots the worker fills) and ``shm_records`` (shared memory: recorded while a run lives, reclaimed once dead).
"""
