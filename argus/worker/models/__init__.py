"""The worker's models: where they come from (:mod:`.sources`), which parts they share
(:mod:`.components`, :mod:`.registry`), and how one denoises (:mod:`.pipelines`, with
:mod:`.cuda_graphs` replaying the UNet's work from CUDA graphs)."""
