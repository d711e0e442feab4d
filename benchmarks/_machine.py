"""The machine line every benchmark prints first."""

import os
import platform


def machine_line() -> str:
    return (
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
