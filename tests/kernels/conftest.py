"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when a ``splitserve.kernels``
module is first imported; this conftest loads before the test modules of this folder import
them. Nothing outside this folder imports Triton.

The interpreter patches triton.language's builtins for each launch (and puts them back after
it), and again at every call of a ``@triton.jit`` helper inside the kernel, where the launch's
patch is in place already: those calls patch nothing new (the builtins are the launch's
wrappers by then, the rest the same wrappers again) but walk the language's modules with
``inspect.getmembers`` each time, 22 of the 81 s that the suite spent in the interpreter.
``skip_nested_patches`` runs such a helper without it, where the launch's kernel sees the
same language modules as the helper (Triton 3.9's interpreter; any other call goes through):
the folder's tests took 97 s instead of 153.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"


def skip_nested_patches() -> None:
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if not triton.__version__.startswith("3.9."):
        return  # another interpreter: its calls as they are
    launches: list[set[int]] = []
    """The language modules that each launch in progress patched, innermost last."""

    def languages(fn: Callable[..., Any]) -> set[int]:
        values = fn.__globals__.values()
        return {id(v) for v in values if inspect.ismodule(v) and v in (tl, tl.core)}

    launch = interpreter.GridExecutor.__call__
    device_call = interpreter.InterpretedFunction.__call__

    def patched_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patched_device_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not launches or not languages(self.fn) <= launches[-1]:
            return device_call(self, *args, **kwargs)
        try:  # InterpretedFunction.__call__ less its _patch_lang
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = patched_launch
    interpreter.InterpretedFunction.__call__ = patched_device_call


skip_nested_patches()
