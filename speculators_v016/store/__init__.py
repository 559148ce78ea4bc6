"""The store: sample files on disk, written atomically and checked.

``sample_format`` (what a file holds), ``atomic_files`` (temp, fsync, rename),
``writer`` (background writers), ``manifest`` (one line per finished file),
``outdir`` (the folder we own), ``run_config`` (data_config.json and resume)
and ``verify`` (which judges states with :mod:`speculators_v016.checks`). It never
imports the engine, the worker or a run.
"""
