"""Image editing (InstGenIE): the edit lane a worker runs edits on (:mod:`.lane`), step-level
continuous batching (:mod:`.scheduler`, :mod:`.step_batch`), and the mask-aware activation
cache (:mod:`.activation_cache`, :mod:`.activation_store`, :mod:`.masked_blocks`)."""
