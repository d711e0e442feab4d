"""Image editing (InstGenIE): how the worker serves edits (:mod:`.worker_edits`), the edit lane
it runs them in (:mod:`.lane`), step-level continuous batching (:mod:`.scheduler`,
:mod:`.step_batch`), and the mask-aware activation cache (:mod:`.activation_cache`,
:mod:`.activation_store`; its compute for one request, :mod:`.masked_blocks`, and for a batch,
:mod:`.packed_blocks`)."""
