"""Triton kernels compiled for Hopper (sm_90) on a machine without a GPU: a script run in a
process of its own, outside Triton's interpreter (which neither compiles nor sees PTX or
shared memory), that prints what a test checks."""

from __future__ import annotations

import os
import subprocess
import sys


def compile_outside_interpreter(script: str) -> str:
    """Runs ``script`` with Python, TRITON_INTERPRET unset; -> its standard output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
