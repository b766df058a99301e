"""zerocc.keep_freed_host_memory: glibc's mallopt through ctypes (opt-in, process-wide)."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import zerocc


def test_bad_values_are_refused_before_anything_is_set():
    for bad in (-1, 2**31, 1.5):
        with pytest.raises(ValueError, match="mallopt values are non-negative ints below 2\\*\\*31"):
            zerocc.keep_freed_host_memory(top_pad=bad)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_takes_the_settings():
    # in a child process: the settings last for the whole process
    code = ("import zerocc, torch; assert zerocc.keep_freed_host_memory(); "
            "x = [torch.ones(1 << 20) for _ in range(8)]; del x")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
