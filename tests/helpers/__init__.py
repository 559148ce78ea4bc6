"""Helpers shared by the test tiers (importable because setup.cfg puts tests/ on pytest's path)."""

#: the token whose input embedding row the ``zero_embedding_model`` fixture zeroes
ZERO_TOKEN = 5
