"""A run: dataset rows in, through the generator, verified files out.

``dataset`` (rows -> token samples), ``pipeline`` (the run), ``cli`` (the
command), ``console`` (the terminal and the log), ``run_report`` (summary, and
the exit code of a failure), ``check`` (the ``check`` command), ``demo``. The
self-checks themselves are in :mod:`speculators_v016.checks`. The top of the
package: nothing below imports this side.
"""
