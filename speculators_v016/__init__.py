"""speculators-v016: our code beside upstream speculators 0.3.0, for vLLM 0.16.

Upstream modules reach this package through the small patches in
``patches/``; the hidden-states generator lives in
:mod:`speculators_v016.generator`. The package logs through loguru and, as a
library, stays quiet until an entry point (our CLI) enables it.
"""

from loguru import logger as _logger

from speculators_v016._version import UPSTREAM_VERSION, __version__

_logger.disable("speculators_v016")

__all__ = ["UPSTREAM_VERSION", "__version__"]
