"""The consumer side of ``speculators-data-gen serve``: a client of its HTTP front, and a dataset for
upstream 0.3.0's trainer that asks the service for each sample (docs/online.md).

It runs in a trainer's processes (and their forked DataLoader workers): it never loads the engine
or a run, only the service's record conventions (:mod:`speculators_v016.serve.publications`) and
the Mooncake client's address rule (:mod:`speculators_v016.serve.mooncake`).
"""

from speculators_v016.online.client import ProducerClient, ProducerError
from speculators_v016.online.dataset import OnlineSampleDataset

__all__ = ["OnlineSampleDataset", "ProducerClient", "ProducerError"]
