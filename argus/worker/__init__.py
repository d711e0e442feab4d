"""The GPU worker: diffusers pipelines at approximation levels, the approximate cache, the gRPC
service (``argus worker``)."""
