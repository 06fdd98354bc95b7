"""The wheel a user installs (issue 29.5): the project's packages and the benchmark suite
under the project's own name (erpo_bench), never a top-level `bench` that any other bench
module would collide with; `python -m bench` still runs from a checkout. Built offline from
a copy of the sources (no build isolation, no index), so the checkout is not written."""
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build_wheel(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("erpo", "erpo_kernels", "bench"):
        shutil.copytree(os.path.join(ROOT, name), src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "local"))
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("erpo-*.whl")
    return wheel


def test_the_wheel_installs_the_benchmark_suite_as_erpo_bench_and_no_top_level_bench(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"erpo", "erpo_kernels", "erpo_bench"}, top
    for module in ("erpo_bench/__main__.py", "erpo_bench/measure.py", "erpo_kernels/token_logprobs.py",
                   "erpo/cli.py", "erpo/integrations/trl.py"):
        assert module in names, module
    # the installed suite runs under its own name, from anywhere, without the checkout
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    run = subprocess.run([sys.executable, "-m", "erpo_bench", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "kernels" in run.stdout, run.stderr
    probe = "import erpo_bench.measure as m, erpo_kernels; print(m.__file__, erpo_kernels.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert where.stdout.split() == [str(tmp_path / "site" / "erpo_bench" / "measure.py"),
                                    str(tmp_path / "site" / "erpo_kernels" / "__init__.py")], where.stderr


def test_python_m_bench_runs_from_a_checkout():
    run = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "kernels" in run.stdout, run.stderr
