"""Execute the notebooks and store them with their outputs (``make notebooks``).

GitHub shows a notebook's stored outputs, so they are kept; the test suite re-executes every
notebook from a clean state. A notebook whose metadata names where it was executed
(``aioautograd.executed_on``, e.g. 04_cuda_streams on a GPU) is re-executed only with
``--all`` (its outputs would otherwise show the simulated device).

Usage: python notebooks/execute.py [--all] [NOTEBOOK ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parent.parent


def execute(path: Path) -> None:
    """Run ``path`` top to bottom in a fresh kernel and write it back with its outputs."""
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    for cell in notebook.cells:
        cell.get("metadata", {}).pop("execution", None)  # timestamps: noise in diffs
    nbformat.write(notebook, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also those executed elsewhere")
    parser.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args()
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        metadata = nbformat.read(path, as_version=4).metadata
        if metadata.get("aioautograd", {}).get("executed_on") and not args.all:
            print(f"{path.name}: kept (executed on {metadata['aioautograd']['executed_on']})")
            continue
        execute(path)
        print(f"{path.name}: executed, {path.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
