"""Where LoRAs live: a flat directory of ``<name>.safetensors`` files.

A request names a LoRA; the library turns the name into a file or refuses it. Names are short
and plain (``[A-Za-z0-9][A-Za-z0-9._-]*``, no ``..``, at most 128 characters), so a name can
never climb out of the directory or pick a file by path; a name whose file resolves outside
the directory (a symlink pointing elsewhere) is treated as unknown as well. The library reads
nothing but directory entries: loading is the loader's job.
"""

from __future__ import annotations

import re
from pathlib import Path

from argus.worker.adapters.lora.errors import LoraNotFoundError

SUFFIX = ".safetensors"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class LoraLibrary:
    """LoRA names → files under ``root`` (``root/<name>.safetensors``)."""

    def __init__(self, root: str | Path) -> None:
        path = Path(root)
        if not path.is_dir():
            raise ValueError(f"LoRA directory {str(root)!r} is not a directory")
        self.root = path.resolve()

    def path(self, name: str, *, field: str = "adapters") -> Path:
        """The file of LoRA ``name``; raises :class:`LoraNotFoundError` if there is none."""
        if not _NAME.match(name) or ".." in name:
            raise LoraNotFoundError(
                name, "not a valid LoRA name (letters, digits, '.', '_' and '-')", field=field
            )
        candidate = (self.root / f"{name}{SUFFIX}").resolve()
        if candidate.parent != self.root or not candidate.is_file():
            # the directory is the server's business: the client gets the name alone
            raise LoraNotFoundError(name, "no such LoRA in this worker's library", field=field)
        return candidate

    def names(self) -> list[str]:
        """Every LoRA name the library can serve, sorted."""
        names = []
        for entry in self.root.glob(f"*{SUFFIX}"):
            name = entry.name[: -len(SUFFIX)]
            if _NAME.match(name) and ".." not in name and entry.resolve().parent == self.root:
                names.append(name)
        return sorted(names)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self.path(name)
        except LoraNotFoundError:
            return False
        return True
