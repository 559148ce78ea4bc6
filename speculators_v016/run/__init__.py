"""A run: dataset rows in, through the generator, verified files out.

``dataset`` (rows -> token samples), ``pipeline`` (the run), ``cli`` (the
command), ``console`` (the terminal and the log), ``run_report`` (summary and
exit codes), ``logit_check``, ``layer_replay`` and ``fidelity`` (self-checks), ``demo``.
"""
