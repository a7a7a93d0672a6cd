"""The README's tour runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_tour_runs() -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None
    result = subprocess.run(
        [sys.executable, "-c", block.group(1)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    # What the comments in the tour promise.
    first_shape, hessian_error, accumulated_shape = result.stdout.splitlines()
    assert first_shape == "(3, 10)"
    assert float(hessian_error) < 1e-5
    assert accumulated_shape == "(3, 10)"
