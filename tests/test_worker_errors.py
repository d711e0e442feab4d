"""What a failed Generate tells its client: the field and the adapter's name, never a
filesystem path of the server (the worker logs those)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from argus.worker.adapters.lora import LoraNotFoundError
from argus.worker.adapters.lora.fileformat import read_file
from argus.worker.adapters.lora.library import LoraLibrary
from argus.worker.models.pipelines import Cancelled
from argus.worker.service import public_details, status_of

pytestmark = pytest.mark.unit


def test_a_missing_lora_is_named_without_the_library_path(tmp_path: Path) -> None:
    with pytest.raises(LoraNotFoundError) as missing:
        LoraLibrary(tmp_path).path("ink", field="adapters[0]")
    assert str(tmp_path) not in str(missing.value)  # not even before the scrub
    code, details = status_of(missing.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT  # the request named it: its error
    assert details.startswith("adapters[0]: LoRA 'ink':")
    assert str(tmp_path) not in details


def test_an_unreadable_lora_file_is_reported_without_its_path(tmp_path: Path) -> None:
    failure = read_file(str(tmp_path / "gone.safetensors"), share=False)
    assert "cannot read its file" in failure.message  # type: ignore[union-attr]
    assert str(tmp_path) not in failure.message  # type: ignore[union-attr]


def test_unexpected_errors_send_their_type_and_log_their_text(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        open(tmp_path / "missing.bin", "rb")  # noqa: SIM115
    except OSError as err:
        code, details = status_of(err)
    assert code is grpc.StatusCode.INTERNAL
    assert details == "internal error (FileNotFoundError); see the worker's log"
    assert str(tmp_path) in caplog.text  # the operator still sees where


@pytest.mark.parametrize(
    ("text", "public"),
    [
        ("no such LoRA in /srv/argus/loras", "no such LoRA in <server path>"),
        ("cannot stat '/tmp/x.safetensors': gone", "cannot stat '<server path>': gone"),
        ("see https://example.org/a/b", "see https://example.org/a/b"),  # a URL stays
        ("level ac-k25/ac-k0, 1/2 done", "level ac-k25/ac-k0, 1/2 done"),
    ],
)
def test_public_details_scrub_absolute_paths_only(text: str, public: str) -> None:
    assert public_details(text) == public


def test_cancelled_work_has_its_own_codes() -> None:
    assert status_of(Cancelled("expired", 3))[0] is grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_of(Cancelled("cancelled"))[0] is grpc.StatusCode.CANCELLED
