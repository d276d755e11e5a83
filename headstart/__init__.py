"""headstart: draft heads (Medusa, EAGLE, DFlash) trained on a frozen target's own outputs, and the decoding that
runs them. One import namespace over the repository's folders: `headstart.train` (train/), `headstart.heads`
(heads/), `headstart.inference` (inference/); the recipes ship as package data (`headstart/recipes` in an install).

An install (`pip install .`) maps those folders into this package (pyproject.toml's package-dir), so site-packages
holds `headstart` alone. A source tree has no such mapping: the folders sit beside this one. So when this file runs
from a source tree (its parent directory holds the pyproject.toml of project "headstart" and the folders heads/,
train/, inference/), that parent directory is appended to this package's search path, and `headstart.heads`
resolves to ./heads: a clone works with no install (`PYTHONPATH=. python -m headstart.inference.bench`, the scripts
under scripts/) and with an editable one (`pip install -e .`, whose finder also maps the folders).
"""

from __future__ import annotations

import re
from pathlib import Path

__version__ = "0.1.0"

STAGE_FOLDERS = ("heads", "train", "inference")


def _source_tree_root() -> Path | None:
    """The repository root when this package runs from a source tree, else None (an install)."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or not all((root / name / "__init__.py").is_file() for name in STAGE_FOLDERS):
        return None
    try:
        text = pyproject.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    # the [project] table's name line (tomllib is Python 3.11+; the package supports 3.10)
    return root if re.search(r'^\[project\][^\[]*?^name\s*=\s*["\']headstart["\']', text, flags=re.M | re.S) else None


_root = _source_tree_root()
if _root is not None and str(_root) not in __path__:
    __path__.append(str(_root))
del _root

# The Python API's entry points, imported on first use (`import headstart` and `headstart --help` stay free of torch):
#     from headstart import Speculator, prompt_ids
_API = {"Speculator": "headstart.inference.speculator", "SpeculatorError": "headstart.inference.speculator",
        "prompt_ids": "headstart.heads.chat", "load_heads": "headstart.heads.load"}


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'headstart' has no attribute {name!r}")
