"""Where a Generate call's progress goes: the callback both sides of the call take.

A worker reports where a request is (:class:`~argus.contracts.generate.Progress`: its stage,
steps, previews) to the sink its caller passed; a router passes one to its worker call and
relays what arrives to its own client. One definition, so the router's and the worker's
signatures cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

from argus.contracts.generate import Progress

ProgressSink = Callable[[Progress], None]
"""Called with each :class:`~argus.contracts.generate.Progress` event of a request."""
