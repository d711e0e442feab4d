"""The GPU worker (``argus worker``): diffusers pipelines at approximation levels, the
approximate cache, image edits and adapters, behind a gRPC service.

Where to start reading, from the outside in:

* :mod:`.app` assembles a worker process from its settings; :mod:`.service` is the gRPC
  servicer, converting and delegating to the engine; :mod:`.membership` sends heartbeats to
  the allocator and follows its plan; :mod:`.metrics` is the one Prometheus adapter.
* :mod:`.engine` is the request path, :class:`~argus.worker.engine.Worker`: validate, queue,
  pick the model, use the cache, denoise, decode, answer. Beside it: :mod:`.gpu_queue` (the
  GPU slot, in arrival order), :mod:`.decode_times` (skipping a decode that cannot finish
  before the deadline) and :mod:`.progress` (the events a streaming caller hears).
* :mod:`.models`: the loaded models and the denoising loop itself.
* :mod:`.approx_cache`: NIRVANA's approximate cache, and its use by a request.
* :mod:`.editing`: image edits, their step-level batching and InstGenIE's activation cache.
* :mod:`.adapters`: LoRAs, ControlNets and latent parallelism.
* :mod:`.scoring`: quality scores of a sample of images, for the router's drift monitor.

The stories behind the shapes, with their measurements, are in ``docs/worker-internals.md``.
"""
