"""The self-checks: is what was captured what the model computes?

``finite`` (no NaN/Inf), ``degenerate`` (no layer a real model never produces: all zeros, or one
row repeated; ``zero_embeddings`` reads the tokens whose zero rows are the model's own from the
checkpoint), ``logit_check`` (the captured last layer, normed and projected, reproduces vLLM's
logits), ``layer_replay`` (one decoder layer at a time in transformers, from the captured stream)
and ``fidelity`` (every layer against transformers on the same weights); ``self_check`` is what
stops a run (:class:`~speculators_v016.checks.self_check.SelfCheckError`) and the samples it holds
back until the logit check has judged. They judge states; they never import the engine, the worker,
the store or a run.
"""
