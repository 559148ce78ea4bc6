"""Worker side: runs inside vLLM's worker processes.

``aux_outputs`` makes the loaded model return the captured layers,
``capture`` copies each step's rows into the engine's ring slot, and the
``cpu_*`` modules adapt vLLM's CPU runner. The engine reaches this side only
through ``collective_rpc`` and the neutral :mod:`speculators_v016.protocol`.
"""
