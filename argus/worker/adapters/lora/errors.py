"""What can go wrong with a requested LoRA, as exception classes the worker maps to gRPC status.

Every error names the adapter (``name``) and the request field that asked for it (``field``,
``"adapters"`` unless the caller says which entry), so the transport can answer with a status
whose message points at the bad input:

=========================  ====================  =============================================
class                      gRPC status           meaning
=========================  ====================  =============================================
:class:`LoraNotFoundError`  ``NOT_FOUND``         no LoRA of that name in the library
:class:`LoraInvalidError`   ``INVALID_ARGUMENT``  the request or the file cannot be used
:class:`LoraFormatError`    ``INVALID_ARGUMENT``  not a (supported) safetensors LoRA file
:class:`LoraMismatchError`  ``INVALID_ARGUMENT``  a key or shape does not fit the model's UNet
:class:`LoraBusyError`      ``RESOURCE_EXHAUSTED``  too many loads in flight; retry later
:class:`LoraLoadError`      ``UNAVAILABLE``       the loader failed (I/O, crashed process, timeout)
=========================  ====================  =============================================

:class:`LoraFormatError` and :class:`LoraMismatchError` are :class:`LoraInvalidError`, so one
``except LoraInvalidError`` covers both.
"""

from __future__ import annotations

from argus.plumbing.quoting import quoted


class LoraError(Exception):
    """Base class: a LoRA named ``name`` (asked for in request field ``field``) cannot be served."""

    def __init__(self, name: str, message: str, *, field: str = "adapters") -> None:
        super().__init__(name, message)
        self.name = name
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return f"LoRA {quoted(self.name)}: {self.message}"

    def at(self, field: str) -> LoraError:
        """A copy of this error that names request field ``field`` (errors of shared loads are
        shared between requests, so a request never edits the original)."""
        other = self.__class__.__new__(self.__class__)
        other.__dict__.update(self.__dict__)
        other.args = self.args
        other.field = field
        return other


class LoraNotFoundError(LoraError):
    """No LoRA of this name in the library (gRPC ``NOT_FOUND``)."""


class LoraInvalidError(LoraError):
    """The request or the LoRA file cannot be used (gRPC ``INVALID_ARGUMENT``)."""


class LoraFormatError(LoraInvalidError):
    """The file is not a safetensors LoRA in the supported layout (gRPC ``INVALID_ARGUMENT``)."""


class LoraMismatchError(LoraInvalidError):
    """A key names no patchable module of the UNet, or a shape does not fit it.

    ``key`` is the first offending key of the file in sorted order.
    """

    def __init__(self, name: str, key: str, message: str, *, field: str = "adapters") -> None:
        super().__init__(name, f"{key}: {message}", field=field)
        self.key = key


class LoraBusyError(LoraError):
    """Too many LoRA loads are in flight (gRPC ``RESOURCE_EXHAUSTED``); the request may retry."""


class LoraLoadError(LoraError):
    """Loading failed for a reason outside the request: I/O error, a crashed loader process, a
    load that did not finish in time (gRPC ``UNAVAILABLE``)."""
