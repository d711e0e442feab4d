"""What crosses a process boundary, in one place, with its protobuf conversion.

The allocator, the routers and the workers are separate processes; each imports the values it
exchanges with the others from here and never another service's internals, so a worker reads
its heartbeat answer and a router reads a plan without loading the allocator's solver.

* :mod:`argus.contracts.wire`: the checks every reader of a message applies
  (:class:`~argus.contracts.wire.FieldError`, size limits) and the enums both sides map, each
  by name to its generated protobuf enum (:func:`~argus.contracts.wire.pb_numbers`);
* :mod:`argus.contracts.workers`: a worker's heartbeat (:class:`WorkerReport`,
  :class:`RetrievalReport`) and the allocator's answer (:class:`HeartbeatAnswer`);
* :mod:`argus.contracts.routers`: a router's statistics (:class:`RouterReport`) and their
  acknowledgement (:class:`RouterAnswer`);
* :mod:`argus.contracts.plans`: the plan as routers receive it (:class:`PublishedPlan`);
* :mod:`argus.contracts.generate`: the Generate call between a router and a worker
  (:class:`GenerateCall`, :class:`GenerateResult` with its :class:`Timing` and
  :class:`QualityScore`, :class:`Progress`, :class:`Adapter` and its :class:`AdapterKind`),
  the one definition both sides use; :mod:`argus.contracts.progress`: the callback its
  progress reaches the caller through (:data:`ProgressSink`);
* :mod:`argus.contracts.router_api`: the router's client API, reusing the Generate fields;
* :mod:`argus.contracts.worker_control`: a worker's Stats and Configure calls
  (:class:`WorkerStats`, :class:`ConfigureCall`, :class:`ModelInfo`);
* :mod:`argus.contracts.controlnet`: what a worker and the ControlNet service exchange without
  a tensor (:class:`ControlUnit`, :class:`OpenInfo`, :class:`ExecutorStats`);
* :mod:`argus.contracts.allocator_client`: the allocator's API as its callers use it
  (:class:`AllocatorClient`, :class:`PlanWatcher`), typed values in and out;
* :mod:`argus.contracts.quality`: per-prompt quality tables and the δ rule that defines a
  prompt's optimal level, shared by the profiler, the classifier and the simulator.

**One layout for every service.** A message family's values and both halves of their
conversion (``*_to_pb``, ``*_from_pb``) live together in one module here; servicers and
clients only call them, and map errors to status codes, so a field is added in one module.
Readers only raise :class:`~argus.contracts.wire.FieldError` (or read an unknown enum as None
where the contract says so); the servicer maps it to INVALID_ARGUMENT. Tensors (torch) and a
refusal's gRPC status stay outside (``docs/control-plane-internals.md`` says where).

The basic values these are made of (levels, profiles, :class:`~argus.types.Plan`, the PASM)
live in :mod:`argus.types`, which imports nothing of Argus. Nothing here imports a service
package (``argus.allocator``, ``argus.router``, ``argus.worker``, ``argus.sim``) or torch.
"""
