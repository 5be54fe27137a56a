"""./dev's CUDA steps without a network or a GPU: its find_nvcc is setup.py's (asked of setup.py itself),
cublas_wheel picks the cuBLAS wheel from nvcc's CUDA major, and install_cuda_wheels asks pip for exactly that
wheel (a stand-in interpreter records the pip call instead of running it). ./dev is sourced, which defines its
functions and runs nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dev(script: str, **environment) -> subprocess.CompletedProcess:
    """SCRIPT run by bash after sourcing ./dev, with ENVIRONMENT added."""
    return subprocess.run(["bash", "-c", f'source "{ROOT / "dev"}"\n{script}'], env={**os.environ, **environment},
                          capture_output=True, text=True, timeout=60)


def fake_nvcc(folder: Path, release: str) -> Path:
    """An executable `nvcc` in FOLDER whose --version names RELEASE, as nvcc's last lines do."""
    folder.mkdir(parents=True, exist_ok=True)
    nvcc = folder / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return nvcc


@pytest.mark.parametrize("release,wheel", [("12.4", "nvidia-cublas-cu12>=12,<13"),
                                           ("13.0", "nvidia-cublas>=13,<14")])
def test_the_cublas_wheel_follows_nvccs_cuda_major(tmp_path, release, wheel):
    result = dev(f'cublas_wheel "{fake_nvcc(tmp_path, release)}"')
    assert result.returncode == 0, result.stderr
    assert result.stdout == wheel + "\n"


def test_an_nvcc_of_another_cuda_major_gets_no_wheel_and_a_reason(tmp_path):
    result = dev(f'cublas_wheel "{fake_nvcc(tmp_path, "11.8")}"')
    assert result.returncode == 1 and result.stdout == ""
    assert "nvcc 11 " in result.stderr and "neither CUDA 12 nor 13" in result.stderr
    assert "KILN_CUBLAS_HOME" in result.stderr


@pytest.mark.parametrize("release,pip_call", [
    ("12.6", "-m pip install --quiet --no-input nvidia-cublas-cu12>=12,<13"),
    ("13.0", "-m pip install --quiet --no-input nvidia-cublas>=13,<14"),
    ("11.8", None),
])
def test_install_cuda_wheels_asks_pip_for_the_matching_wheel(tmp_path, release, pip_call):
    """The venv's interpreter is a stand-in: it runs find_nvcc's question to setup.py with this interpreter and
    records any pip call in calls.txt."""
    calls = tmp_path / "calls.txt"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\n[ "$1" = -m ] && {{ echo "$*" >>"{calls}"; exit 0; }}\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    nvcc = fake_nvcc(tmp_path / "cuda" / "bin", release)
    result = dev(f'VENV="{tmp_path / "venv"}"\ninstall_cuda_wheels', KILN_NVCC=str(nvcc))
    assert result.returncode == 0, result.stderr
    assert (calls.read_text().splitlines() if calls.exists() else []) == ([pip_call] if pip_call else [])
    if pip_call:
        assert f"nvcc ({nvcc}) found: installing" in result.stderr


@pytest.mark.parametrize("release,pip_calls", [
    ("13.0", ["-m pip install --quiet --no-input nvidia-cublas>=13,<14",
              "-m pip install --quiet --no-input nvidia-cuda-cuobjdump>=13,<14"]),
    ("12.6", ["-m pip install --quiet --no-input nvidia-cublas-cu12>=12,<13"]),
])
def test_for_the_tests_install_cuda_wheels_adds_cuobjdump_where_nvcc_has_none(tmp_path, release, pip_calls):
    """`install_cuda_wheels test` (the test install) also installs CUDA 13's cuobjdump wheel when neither PATH nor
    nvcc's folder has cuobjdump, so tests/engine/test_cuda_build.py reads the built library's targets in CI; CUDA
    12 has no such wheel."""
    calls = tmp_path / "calls.txt"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\n[ "$1" = -m ] && {{ echo "$*" >>"{calls}"; exit 0; }}\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    nvcc = fake_nvcc(tmp_path / "cuda" / "bin", release)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "cuobjdump").exists())
    result = dev(f'VENV="{tmp_path / "venv"}"\ninstall_cuda_wheels test', KILN_NVCC=str(nvcc), PATH=path)
    assert result.returncode == 0, result.stderr
    assert calls.read_text().splitlines() == pip_calls
    (nvcc.parent / "cuobjdump").write_text("#!/bin/sh\n")
    (nvcc.parent / "cuobjdump").chmod(0o755)
    calls.unlink()
    result = dev(f'VENV="{tmp_path / "venv"}"\ninstall_cuda_wheels test', KILN_NVCC=str(nvcc), PATH=path)
    assert calls.read_text().splitlines() == pip_calls[:1]  # the toolkit's own cuobjdump is enough


def test_without_nvcc_install_cuda_wheels_installs_nothing(tmp_path):
    result = dev('find_nvcc() { return 1; }\nVENV=/nonexistent\ninstall_cuda_wheels\necho done')
    assert result.returncode == 0 and result.stdout == "done\n", result.stderr


def setup_find_nvcc(environment: dict):
    """setup.py's own find_nvcc under ENVIRONMENT (its module-level code needs the build tools; this does not)."""
    import ast
    import shutil

    tree = ast.parse((ROOT / "setup.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "find_nvcc")
    namespace = {"os": os, "shutil": shutil}
    exec(compile(ast.Module([node], type_ignores=[]), "setup.py", "exec"), namespace)
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(environment)
        return namespace["find_nvcc"]()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("case", ["KILN_NVCC", "PATH", "CUDA_HOME", "CUDA_PATH", "nothing"])
def test_dev_finds_the_nvcc_setup_py_finds(tmp_path, case):
    """Each place setup.py looks, in turn (a missing KILN_NVCC falls through to the next)."""
    bare = tmp_path / "bare"  # a PATH without nvcc
    bare.mkdir()
    for tool in ("sh", "bash", "dirname", "sed", "cat"):
        if (found := subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()):
            os.symlink(found, bare / tool)
    environment = {"PATH": str(bare), "KILN_NVCC": str(tmp_path / "missing" / "nvcc")}
    if case == "KILN_NVCC":
        environment["KILN_NVCC"] = str(fake_nvcc(tmp_path / "chosen", "13.0"))
    elif case == "PATH":
        environment["PATH"] = f"{fake_nvcc(tmp_path / 'on-path', '13.0').parent}:{bare}"
    elif case in ("CUDA_HOME", "CUDA_PATH"):
        environment[case] = str(fake_nvcc(tmp_path / case / "bin", "12.4").parent.parent)
    expected = setup_find_nvcc(environment)
    if case == "nothing" and expected is not None:
        pytest.skip(f"{expected} is installed, so setup.py always finds an nvcc here")
    if case != "nothing":
        assert expected is not None and str(tmp_path) in expected
    result = subprocess.run(["bash", "-c", f'source "{ROOT / "dev"}"\nfind_nvcc "{sys.executable}"'],
                            env=environment, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == ((0, expected + "\n") if expected else (1, "")), result.stderr
