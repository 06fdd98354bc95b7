"""The live suites (tests/vllm_live, tests/verl_live) run in their own venvs, each by naming its
directory; the main suite (`pytest tests`) leaves them out by tests/conftest.py's collect_ignore,
the one mechanism for both."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def test_every_live_suite_is_left_out_of_the_main_suite():
    assert sorted(conftest.collect_ignore) == sorted(p.name for p in TESTS.iterdir() if p.name.endswith("_live"))


def test_pytest_tests_leaves_the_live_suites_out_and_naming_one_collects_it(tmp_path):
    """On a copy of the layout: `pytest tests` collects neither live suite and does not even
    import one whose conftest cannot be imported here (as verl's, outside its venv); a live
    suite's directory named on the command line is collected."""
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(TESTS / "conftest.py", tests / "conftest.py")
    shutil.copy(TESTS / "_interpreter_speed.py", tests / "_interpreter_speed.py")  # conftest imports it
    (tests / "test_main.py").write_text("def test_main():\n    pass\n")
    for name in conftest.collect_ignore:
        (tests / name).mkdir()
        (tests / name / f"test_{name}.py").write_text("def test_live():\n    pass\n")
    (tests / "verl_live" / "conftest.py").write_text("raise ImportError('not in this venv')\n")

    def collected(directory: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               directory], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    main = collected("tests")
    assert "tests/test_main.py::test_main" in main and "_live" not in main and "1 test collected" in main, main
    assert "tests/vllm_live/test_vllm_live.py::test_live" in collected("tests/vllm_live")
