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
    # Notebooks are stored executed, so that GitHub shows their outputs (python
    # notebooks/execute.py), and small; they are cleared and run again here.
    assert path.stat().st_size < 256 * 1024, f"{path.name}: outputs too large, shrink figures"
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: not stored executed in order"
    assert any(cell.outputs for cell in code)
    assert not [o for cell in code for o in cell.outputs if o.get("output_type") == "error"]
    for cell in code:
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
