"""Worker processes that a test starts itself (Gloo peers, the ranks of an expert-parallel
group): forked from the session's forkserver, which imported torch and the engine once.

A spawned process imports them again, and pytest with them: about 1.3 s of CPU and 2.5 s
on the 2-core VM each (measured), for the 15 such processes of the suite. The forkserver
never runs a torch operation, so its children inherit no OpenMP thread pool; each starts as
a spawned one would, with the test process's environment and import path."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

PRELOAD = ["torch", "splitserve.engine.llm_engine", "splitserve.kvstore.transfer"]


def context() -> BaseContext:
    """The forkserver context, its server started (on first use) with PRELOAD imported."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
