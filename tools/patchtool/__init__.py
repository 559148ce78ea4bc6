"""Patch-queue tooling for speculators-v016.

Upstream speculators arrives as a pinned release artifact (``patches/upstream.json``);
our changes to it are the ordered git patches in ``patches/series``. This
package materialises upstream + series as a git work tree (first commit =
pristine upstream, one commit per patch), exports the series back from it,
checks it, and replays it onto newer upstream releases. It is used both by
``tools/patches.py`` and by the build backend, so a wheel is always built by
the same mechanism a maintainer uses by hand.
"""
