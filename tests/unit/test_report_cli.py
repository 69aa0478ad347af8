"""python -m report's usage errors: exit code 2 and one line that says what to fix; no server is asked."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from report import EXIT_USAGE
from report.__main__ import Progress, main, share
from tests.sample_images import encode, photo

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton


@pytest.fixture(autouse=True)
def no_shim_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("SHIM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def model_files(tmp_path: Path) -> list[str]:
    """Files that exist: nothing here loads them, a usage error comes first."""
    (tmp_path / "model.pt").write_bytes(b"not loaded")
    (tmp_path / "labels.txt").write_text("cat\ndog\n" * 500)  # resnet50's description: 1,000 classes
    # 127.0.0.1:9 (discard): nothing is asked before the usage error
    return ["--triton-url", "127.0.0.1:9", "--legacy-model", str(tmp_path / "model.pt"),
            "--labels", str(tmp_path / "labels.txt")]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = int(e.code or 0)
    err = capsys.readouterr().err
    return code, err


def images(folder: Path, count: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{i}.jpg").write_bytes(encode(photo(64, 48, seed=i)))
    return folder


@pytest.mark.parametrize(("argv", "says"), [
    (["{missing}"], "is not a folder"),
    (["{empty}"], "holds no file"),
    (["{text}"], "none of the 1 files under"),
    (["{images}", "--min-top1-agreement", "101%"], "--min-top1-agreement must be from 0 to 1"),
    (["{images}", "--min-top1-agreement", "most"], "is not a share"),
    (["{images}", "--max-p99-ratio", "0"], "--max-p99-ratio must be > 0"),
    (["{images}", "--max-errors", "-1"], "--max-errors must be >= 0"),
    (["{images}", "--concurrency", "0"], "--concurrency must be at least 1"),
    (["{images}", "--transport", "pigeon"], "invalid choice: 'pigeon'"),
    (["{images}", "--triton-url", "http://host/v2"], "--triton-url / SHIM_TRITON_URL="),
    (["{images}", "--legacy-model", "{tmp}/nope.pt"], "legacy model"),
    (["{images}", "--labels", "{tmp}/nope.txt"], "labels file"),
    (["{images}", "--top-k", "1001"], "--top-k 1001 is more than the 1000 classes"),
    (["{images}", "--labels", "{tmp}/short.txt"], "has 2 labels, but triton_repo/resnet50/model.toml says [output] "
                                                  "classes = 1000"),
    (["{images}", "--no-such-option"], "unrecognized arguments"),
])
def test_usage_errors_exit_2_with_one_clear_line(argv: list[str], says: str, tmp_path: Path, model_files: list[str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "notes.txt").write_text("hello")
    (tmp_path / "short.txt").write_text("cat\ndog\n")
    places = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "text": tmp_path / "text",
              "images": images(tmp_path / "images"), "tmp": tmp_path}
    filled = [a.format(**places) for a in argv]
    given = {a for a in filled if a.startswith("--")}
    for option, value in zip(model_files[::2], model_files[1::2], strict=True):
        if option not in given:
            filled += [option, value]
    code, err = run(filled, capsys)
    assert code == EXIT_USAGE, err
    assert says in err, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("migration report: "), err
    assert not (tmp_path / "images" / "report.md").exists()


def test_shares_are_fractions_or_percentages() -> None:
    assert share("0.999") == pytest.approx(0.999) and share("99.9%") == pytest.approx(0.999)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_line_on_a_terminal_and_silent_elsewhere() -> None:
    from report.compare import Outcome

    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = Progress(3, stream)
        for i in range(3):
            progress(Outcome(f"{i}.txt", skipped="invalid_image"))
        progress.close()
    assert pipe.getvalue() == ""
    shown = terminal.getvalue()
    assert shown.startswith("\r[") and shown.endswith("\n") and "\n" not in shown[:-1]
    assert "3/3 files, top-1 differs 0, errors 0, skipped 3" in shown.split("\r")[-1]
