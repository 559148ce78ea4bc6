"""The test kit: tiny real models built locally, and fault injection. Not used by a production run
(the demo builds its model with :mod:`~speculators_v016.testing.tiny_models`). It never imports
the CLI: fault injection runs the installed command through its entry point."""
