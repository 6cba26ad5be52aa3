"""`splitserve serve | scale | make-tiny-model | bench serve | bench offline | bench eplb`.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up, importing lazily so that
`splitserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("splitserve.services.launch.serve", "start the OpenAI-compatible service"),
    "scale": ("splitserve.services.launch.scale_cli", "resize a running deployment's pools live"),
    "make-tiny-model": (
        "splitserve.tiny_vlm",
        "write a tiny random vision-language model (no download)",
    ),
    "bench serve": ("splitserve.bench.serve", "load-test an OpenAI-compatible endpoint"),
    "bench offline": (
        "splitserve.bench.offline",
        "engine prefill/decode throughput vs transformers",
    ),
    "bench eplb": ("splitserve.bench.eplb", "expert-parallel load balancing simulator"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported (a missing one fails alone)."""
    chosen = " ".join(argv[:2]) if argv[:1] == ["bench"] else " ".join(argv[:1])
    parser = argparse.ArgumentParser(prog="splitserve")
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, (module_name, help_text) in _COMMANDS.items():
        parts = name.split()
        if len(parts) == 1:
            sub = top.add_parser(parts[0], help=help_text)
        else:
            if parts[0] not in groups:
                group_parser = top.add_parser(parts[0], help=f"{parts[0]} subcommands")
                groups[parts[0]] = group_parser.add_subparsers(dest="subcommand", required=True)
            sub = groups[parts[0]].add_parser(parts[1], help=help_text)
        sub.set_defaults(_module=module_name)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
