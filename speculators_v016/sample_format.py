"""Kept import path: sample files are read and written by :mod:`speculators_v016.store.sample_format`."""

from speculators_v016.store.sample_format import encode_parts, load_sample, parse_sample_name, sample_name

__all__ = ["encode_parts", "load_sample", "parse_sample_name", "sample_name"]
