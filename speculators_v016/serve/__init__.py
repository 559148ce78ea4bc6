"""The capture engine as a service: online hidden states for a trainer, no dataset on disk.

The data path, one module each::

    http_api.HttpFront        POST /v1/samples {index | input_ids+loss_mask} -> waits -> {handle}
      service.CaptureService  requests from every client -> one CaptureEngine.stream (batched, async
                              scheduling, the ring) -> screened -> publisher threads
        folder.ServeDir       each sample's file written to the serve folder (atomic rename), its
                              record kept; bytes not yet taken are capped (backpressure); what a dead
                              consumer left is reclaimed by that record
    speculators_v016.online   the consumer: a map-style dataset for upstream's trainer that asks
                              for sample i and reads (then deletes, or caches) its file

The service and its consumer sit on top, beside a run (:mod:`speculators_v016.run`, whose dataset
loading the service shares): nothing below imports them. ``speculators-data-gen serve`` drives it (:mod:`speculators_v016.serve.driver`); docs/online.md is
the manual.
"""
