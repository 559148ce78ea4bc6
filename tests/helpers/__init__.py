"""Helpers shared by the test tiers (importable because setup.cfg puts tests/ on pytest's path)."""
