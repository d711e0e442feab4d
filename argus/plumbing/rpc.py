"""The gRPC API's generated code, built from ``proto/`` on demand and never edited by hand.

``proto/argus/v1/*.proto`` (package ``argus.v1``) is compiled with ``grpc_tools.protoc`` into
``argus/v1/`` (ignored by git), so the generated modules import as ``argus.v1.worker_pb2``.
:func:`ensure_generated` rebuilds them when a ``.proto`` file is newer than its output or the
output is missing; a lock file makes concurrent first imports (several worker processes, test
workers) safe. ``python -m argus.plumbing.rpc`` builds them ahead of time (CI, container images).

Import the modules through :func:`load`, which guarantees they exist first.
"""

from __future__ import annotations

import fcntl
import importlib
import sys
from pathlib import Path
from types import ModuleType

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # .../argus, above argus/plumbing
REPO_ROOT = PACKAGE_ROOT.parent
PROTO_ROOT = REPO_ROOT / "proto"
OUT_DIR = PACKAGE_ROOT / "v1"


class ProtoBuildError(RuntimeError):
    pass


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "argus" / "v1").glob("*.proto"))


def _outputs(proto: Path) -> list[Path]:
    stem = proto.stem
    return [
        OUT_DIR / f"{stem}_pb2.py",
        OUT_DIR / f"{stem}_pb2.pyi",
        OUT_DIR / f"{stem}_pb2_grpc.py",
    ]


def _stale() -> bool:
    for proto in proto_files():
        mtime = proto.stat().st_mtime
        for out in _outputs(proto):
            if not out.exists() or out.stat().st_mtime < mtime:
                return True
    return False


def ensure_generated() -> None:
    """Compile ``proto/`` into ``argus/v1`` if any output is missing or older than its source."""
    protos = proto_files()
    if not protos:
        if all((OUT_DIR / n).exists() for n in ("worker_pb2.py", "common_pb2.py")):
            return  # an installed package that shipped its generated code
        raise ProtoBuildError(f"no .proto files under {PROTO_ROOT} and no generated code")
    if not _stale():
        return
    OUT_DIR.mkdir(exist_ok=True)
    with (PACKAGE_ROOT / ".proto-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _stale():
            return
        from grpc_tools import protoc

        include = Path(protoc.__file__).resolve().parent / "_proto"
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={PACKAGE_ROOT.parent}",
            f"--pyi_out={PACKAGE_ROOT.parent}",
            f"--grpc_python_out={PACKAGE_ROOT.parent}",
            *(str(p) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise ProtoBuildError(f"protoc failed on {', '.join(p.name for p in protos)}")
        init = OUT_DIR / "__init__.py"
        if not init.exists():
            init.write_text(
                '"""Generated from proto/argus/v1 by argus.plumbing.rpc; do not edit."""\n'
            )


def load(name: str) -> ModuleType:
    """``load("worker_pb2")`` imports ``argus.v1.worker_pb2``, generating it first if needed."""
    ensure_generated()
    return importlib.import_module(f"argus.v1.{name}")


if __name__ == "__main__":
    ensure_generated()
    print(f"generated {', '.join(p.name for p in proto_files())} into {OUT_DIR}", file=sys.stderr)
