"""LoRA adapters with bounded asynchronous loading (BAL), after Katz §6.

A request names LoRAs from a library directory. The worker starts denoising at once while
loader processes read the files into shared memory; each LoRA is merged into the UNet's
weights in place at the first step boundary after it is ready, and at step K (the bound) the
run waits for any still loading. After the run the base weights are copied back exactly.

Parts, one job each:

* :mod:`.fileformat`: the safetensors LoRA layout, parsed and checked; the loader's reader;
* :mod:`.library`: names → files in one directory;
* :mod:`.patch`: loaded LoRAs, the fit check against a UNet, the in-place merge and its backup;
* :mod:`.session`: one request's BAL (``before_step`` / ``after_step`` / ``close``);
* :mod:`.loader`: the process pool, the in-flight bound, the cache; opens sessions;
* :mod:`.bound`: profiling K from latent cosine similarity (``argus profile-lora``);
* :mod:`.synthetic`: seeded random LoRA files for tiny models (tests, demos, benchmarks);
* :mod:`.errors`: the exceptions and the gRPC status each maps to.

Worker wiring::

    loader = LoraLoader(LoraLibrary(lora_dir), LoraConfig(...)); loader.warm()   # at start
    requests = requests_from_adapters(call.adapters)                              # per request
    session = loader.open_session(model.pipeline.unet, requests, steps=spec.steps,
                                  bound=k, lock=model.lock)
    with session:
        model.denoise(spec, before_step=[session.before_step], hooks=[session.after_step],
                      on_exit=[session.on_exit])
    loader.close()                                                                # at shutdown
"""

from argus.worker.adapters.lora.bound import BoundProfile, latent_cosine, profile_bound
from argus.worker.adapters.lora.errors import (
    LoraBusyError,
    LoraError,
    LoraFormatError,
    LoraInvalidError,
    LoraLoadError,
    LoraMismatchError,
    LoraNotFoundError,
)
from argus.worker.adapters.lora.library import LoraLibrary
from argus.worker.adapters.lora.loader import LoaderStats, LoraConfig, LoraLoader, load_now
from argus.worker.adapters.lora.patch import LoadedLora, LoraModule, WeightBackup, check_fits, merge
from argus.worker.adapters.lora.session import (
    LoraMergeStats,
    LoraRequest,
    LoraSession,
    LoraSessionStats,
    PendingLora,
    requests_from_adapters,
)
from argus.worker.adapters.lora.synthetic import write_tiny_lora

__all__ = [
    "BoundProfile",
    "LoadedLora",
    "LoaderStats",
    "LoraBusyError",
    "LoraConfig",
    "LoraError",
    "LoraFormatError",
    "LoraInvalidError",
    "LoraLibrary",
    "LoraLoadError",
    "LoraLoader",
    "LoraMergeStats",
    "LoraMismatchError",
    "LoraModule",
    "LoraNotFoundError",
    "LoraRequest",
    "LoraSession",
    "LoraSessionStats",
    "PendingLora",
    "WeightBackup",
    "check_fits",
    "latent_cosine",
    "load_now",
    "merge",
    "profile_bound",
    "requests_from_adapters",
    "write_tiny_lora",
]
