"""This distribution's version: upstream base release, then our revision."""

UPSTREAM_VERSION = "0.3.0"
__version__ = f"{UPSTREAM_VERSION}.post1"
