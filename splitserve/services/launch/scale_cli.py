"""`splitserve scale --prefill N --decode M`: resize a running deployment's pools live.

It calls the server's `POST /admin/scale`; the server starts the new workers, and drains the
removed ones (no new requests, the ones they hold finish) before it stops them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

SCALE_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the API server")
    parser.add_argument("--prefill", type=int, default=None, help="prefill replicas")
    parser.add_argument("--decode", type=int, default=None, help="decode replicas")
    parser.add_argument("--vision", type=int, default=None, help="vision replicas")
    parser.add_argument(
        "--pool",
        dest="pools",
        action="append",
        default=[],
        metavar="NAME=N",
        help="replicas of a pool by its name (e.g. a colocated pool: --pool worker=2)",
    )
    parser.add_argument(
        "--admin-key",
        default=None,
        help="one of the server's admin keys (server.admin_keys; default: $SPLITSERVE_ADMIN_KEY)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="the server's API key, for a loopback server without admin keys "
        "(default: $SPLITSERVE_API_KEY)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        replicas = _replicas(args)
    except ValueError as exc:
        print(f"splitserve scale: {exc}", file=sys.stderr)
        return 2
    key = (
        args.admin_key
        or os.environ.get("SPLITSERVE_ADMIN_KEY")
        or args.api_key
        or os.environ.get("SPLITSERVE_API_KEY")
    )
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"{args.base_url.rstrip('/')}/admin/scale"
    try:
        response = httpx.post(
            url, json={"replicas": replicas}, headers=headers, timeout=SCALE_TIMEOUT_S
        )
    except httpx.HTTPError as exc:
        print(f"splitserve scale: {url}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"splitserve scale: {response.status_code} {response.text}", file=sys.stderr)
        return 1
    for name, pool in response.json()["pools"].items():
        print(f"{name} ({pool['role']}): {len(pool['workers'])} {json.dumps(pool['workers'])}")
    return 0


def _replicas(args: argparse.Namespace) -> dict[str, int]:
    replicas = {
        role: count
        for role, count in (
            ("prefill", args.prefill),
            ("decode", args.decode),
            ("vision", args.vision),
        )
        if count is not None
    }
    for item in args.pools:
        name, sep, count = item.partition("=")
        if not sep or not count.isdigit():
            raise ValueError(f"--pool {item!r} is not of the form NAME=N")
        replicas[name] = int(count)
    if not replicas:
        raise ValueError("nothing to scale: give --prefill, --decode, --vision or --pool NAME=N")
    return replicas
