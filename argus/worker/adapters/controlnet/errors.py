"""Errors of the ControlNet path, the same classes whether the ControlNets run in process or
behind the gRPC service.

Each error names the request field it is about (``controlnets[1].name``, ``step.sample``), and
its message starts with that field, so a gRPC status detail reads like the worker's own
``INVALID_ARGUMENT`` details. :mod:`argus.worker.adapters.controlnet.service` maps the classes to
status codes and :mod:`argus.worker.adapters.controlnet.client` maps the codes back, so a worker
catches one set of classes for both executors:

=================================  ======================
class                              gRPC status
=================================  ======================
:class:`UnknownControlNetError`    ``NOT_FOUND``
:class:`InvalidControlNetRequest`  ``INVALID_ARGUMENT``
  (:class:`FamilyMismatchError`,
  :class:`ControlImageError`,
  :class:`TensorCodecError`)
:class:`ControlNetBusyError`       ``RESOURCE_EXHAUSTED``
:class:`ControlNetUnavailableError` ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``
:class:`ControlNetLoadError`       ``INTERNAL``
=================================  ======================
"""

from __future__ import annotations


class ControlNetError(Exception):
    """Base class; ``field`` names the request field the error is about ("" when none)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class UnknownControlNetError(ControlNetError, LookupError):
    """A ControlNet name that no family of the catalog knows."""


class InvalidControlNetRequest(ControlNetError, ValueError):
    """A request the ControlNets cannot run: a bad field, shape, dtype or value."""


class FamilyMismatchError(InvalidControlNetRequest):
    """A ControlNet that exists, but for another base family than the request's."""


class ControlImageError(InvalidControlNetRequest):
    """A control image that is not a decodable PNG of an acceptable size."""


class TensorCodecError(InvalidControlNetRequest):
    """A tensor on the wire whose dtype, shape or byte count does not add up."""


class ControlNetBusyError(ControlNetError):
    """The service holds its maximum of open sessions; retry later or elsewhere."""


class ControlNetUnavailableError(ControlNetError):
    """The service cannot be reached, or did not answer in time."""


class ControlNetLoadError(ControlNetError):
    """A ControlNet of the catalog failed to load (corrupt or unreadable weights)."""
