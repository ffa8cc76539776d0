"""Documented functions of this interpreter's standard library: material for training prompts
(training/corpus.py) and the repetitive workload (data/prompts.py), found on any machine without a download."""

from __future__ import annotations

import ast
import os
import sysconfig
import textwrap
from functools import cache

__all__ = ["stdlib_functions"]


@cache
def stdlib_functions(max_doc_chars: int = 600) -> tuple[tuple[str, str, str, str], ...]:
    """(name, signature, docstring, source) of documented top-level and method functions in the stdlib.

    Reads the .py files of this interpreter's stdlib (tests, idlelib, tkinter and private modules skipped), sorted
    by path so the order is stable.
    """
    root = sysconfig.get_paths()["stdlib"]
    skip_dirs = {"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages", "lib2to3", "ensurepip",
                 "__pycache__", "pydoc_data", "unittest", "distutils"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith(("_", ".")))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("_"):
                continue
            path = os.path.join(dirpath, fn)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                tree = ast.parse(text)
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = text.splitlines()
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                if not doc or len(doc) < 40 or len(doc) > max_doc_chars:
                    continue
                src = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
                if len(src) > 2500:
                    continue
                sig = "(" + ast.unparse(node.args) + ")"
                out.append((node.name, sig, doc.strip(), src))
    return tuple(out)
