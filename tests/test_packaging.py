"""The wheel a user installs (issue 29.5): the project's packages and the benchmark suite
under the project's own name (erpo_bench), never a top-level `bench` that any other bench
module would collide with; `python -m bench` still runs from a checkout. Built offline from
a copy of the sources (no build isolation, no index), so the checkout is not written."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build_wheel(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("erpo", "erpo_kernels", "bench", "configs"):
        shutil.copytree(os.path.join(ROOT, name), src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "local"))
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("erpo-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel's file names, the directory it is unpacked in): built once for the module."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    return names, tmp_path / "site"


def test_the_wheel_installs_the_benchmark_suite_as_erpo_bench_and_no_top_level_bench(installed, tmp_path):
    names, site = installed
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"erpo", "erpo_kernels", "erpo_bench"}, top
    for module in ("erpo_bench/__main__.py", "erpo_bench/measure.py", "erpo_kernels/token_logprobs.py",
                   "erpo/cli.py", "erpo/integrations/trl.py"):
        assert module in names, module
    # the installed suite runs under its own name, from anywhere, without the checkout
    env = dict(os.environ, PYTHONPATH=str(site))
    run = subprocess.run([sys.executable, "-m", "erpo_bench", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "kernels" in run.stdout, run.stderr
    # ... and says so (issue 35 item 6): its own name, not the checkout's
    assert run.stdout.startswith("usage: python -m erpo_bench"), run.stdout
    assert "python -m erpo_bench kernels" in run.stdout and "python -m bench" not in run.stdout
    assert "bench/__init__.py" not in run.stdout
    # the ahead-of-time compile check is one of its subcommands (issue 35.1), its errors one line
    run = subprocess.run([sys.executable, "-m", "erpo_bench", "aot", "--archs", "91"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("python -m erpo_bench aot: error: argument --archs:")
    probe = "import erpo_bench.measure as m, erpo_kernels; print(m.__file__, erpo_kernels.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert where.stdout.split() == [str(site / "erpo_bench" / "measure.py"),
                                    str(site / "erpo_kernels" / "__init__.py")], where.stderr


def test_python_m_bench_runs_from_a_checkout():
    run = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "kernels" in run.stdout, run.stderr


def test_the_installed_suite_and_configs_work_from_another_directory(installed, tmp_path):
    """From the wheel (issue 35 item 6): `erpo_bench report` with no results is an error, not
    a success that wrote nothing; results default to the current directory, not
    site-packages; --record (the checkout's record) is refused; the configs ship as package
    data, reachable by name (erpo train demo, erpo study study-epochs)."""
    names, site = installed
    assert {"erpo/configs/demo.yaml", "erpo/configs/study-epochs.yaml"} <= set(names)
    env = dict(os.environ, PYTHONPATH=str(site))

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)

    report = run("-m", "erpo_bench", "report")
    assert report.returncode == 1 and report.stderr.startswith("erpo: error: no bench results in "), report.stderr
    assert str(tmp_path / "erpo-bench-results") in report.stderr
    probe = ("import argparse, erpo_bench.__main__ as b, erpo_bench.measure as m\n"
             "from erpo.named_configs import config_path as c\n"
             "print(m.LOCAL_RESULTS_DIR, m.IN_CHECKOUT, c('demo'), c('configs/study-epochs.yaml'))\n"
             "try:\n    b._out_dir(argparse.Namespace(out_dir=None, record=True))\n"
             "except SystemExit as e:\n    print(e)")
    where = run("-c", probe)
    lines = where.stdout.splitlines()
    assert lines[0].split() == [str(tmp_path / "erpo-bench-results"), "False", str(site / "erpo" / "configs" / "demo.yaml"),
                                str(site / "erpo" / "configs" / "study-epochs.yaml")], where.stderr
    assert lines[1].startswith("erpo: error: --record appends to the project's record"), lines
    missing = run("-m", "erpo", "train", "nosuch")
    assert missing.returncode == 2 and "the shipped configs, by name: demo, " in missing.stderr, missing.stderr
