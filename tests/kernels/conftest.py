"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when a ``splitserve.kernels``
module is first imported; this conftest loads before the test modules of this folder import
them. Nothing outside this folder imports Triton.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
