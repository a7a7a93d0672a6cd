"""Every notebook under notebooks/ runs top to bottom, headless."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(path, as_version=4)
    # A notebook is stored without outputs, unless its metadata says where they come from
    # (04_cuda_streams keeps the outputs of a run on a GPU): they are cleared for this run.
    executed_on = notebook.metadata.get("aioautograd", {}).get("executed_on")
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert executed_on or not cell.outputs, f"{path.name} has outputs; clear them"
            cell.outputs = []
            cell.execution_count = None
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.get("output_type") == "error"
    ]
    assert not errors
