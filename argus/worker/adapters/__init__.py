"""Katz's adapter workflows on a worker: a request's adapters planned and attached
(:mod:`.workflow`), bounded asynchronous LoRA loading (:mod:`.lora`), ControlNet-as-a-Service
(:mod:`.controlnet`) and latent parallelism across two devices (:mod:`.latent_parallel`)."""
