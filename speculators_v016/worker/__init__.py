"""Worker side: runs inside vLLM's worker processes.

``aux_outputs`` makes the loaded model return the captured layers, after
``stream_proof`` has established on the loaded model where the residual stream
is at each of them (``check_forward`` runs that check's forward in vLLM),
``capture`` copies each step's rows into the engine's ring slot, and the
``cpu_*`` modules adapt vLLM's CPU runner. The engine reaches this side only
through ``collective_rpc`` and the neutral :mod:`speculators_v016.protocol`.
"""
