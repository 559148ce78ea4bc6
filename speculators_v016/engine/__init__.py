"""Engine side: drives vLLM 0.16 step by step and turns captured rows into per-request states.

``core`` (the step loop), ``executor`` (vLLM's executor plus our capture RPC),
``assembly`` (rows -> requests, attributed twice), ``buffer_pool`` and ``vllm_check``. The ring
the worker fills and the shared-memory records are in :mod:`speculators_v016.shared`, which the
worker imports too; this side never imports the worker, the store or a run.
"""
