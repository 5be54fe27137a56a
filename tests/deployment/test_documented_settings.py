"""The settings tables say what the code does: each default a row of docs/deployment.md or of the README's
Configuration table gives is the default kiln_web/settings.py takes (read from its env_* calls), and every
KILN_* variable the runtime, the engine or the build reads from the environment is in docs/deployment.md."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| (`[A-Z][A-Z0-9_]*`(?:(?: / |, )`[A-Z][A-Z0-9_]*`)*) \| ([^|]*) \|", re.MULTILINE)
ENVIRON = re.compile(r"(?:environ(?:\.get)?\(|environ\[|getenv\()\s*\"(KILN_[A-Z0-9_]+)\"")


def setting_defaults() -> dict:
    """NAME -> the default of each env_*("NAME", DEFAULT, ...) call in settings.py whose default is a constant
    expression (a number, a string, a list of strings, 64 << 20)."""
    defaults = {}
    for node in ast.walk(ast.parse((ROOT / "kiln_web" / "settings.py").read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.startswith("env_")
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Constant)):
            try:
                defaults[node.args[0].value] = eval(compile(ast.Expression(node.args[1]), "settings", "eval"),
                                                    {"__builtins__": {}})
            except NameError:
                pass  # a default computed from another setting (KILN_ASSETS_DIR: the checkout)
    return defaults


def documented_defaults(page: str) -> list[tuple[str, str]]:
    """(NAME, the first `value` of its Default column) for each settings-table row of PAGE; a row naming several
    variables gives each the value at its position."""
    rows = []
    for names, default in ROW.findall((ROOT / page).read_text()):
        names = re.findall(r"`([A-Z][A-Z0-9_]*)`", names)
        values = re.findall(r"`([^`]*)`", default)
        if default.strip().startswith("`") and len(values) >= len(names):
            rows.extend(zip(names, values))
    return rows


def as_documented(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(value)
    return str(value)


@pytest.mark.parametrize("page", ["docs/deployment.md", "README.md"])
def test_every_documented_default_is_the_settings_default(page):
    defaults = setting_defaults()
    assert defaults["KILN_CHECKPOINT_INTERVAL"] == 50 and defaults["KILN_UPLOAD_MAX_BYTES"] == 64 << 20
    rows = [(name, value) for name, value in documented_defaults(page) if name in defaults]
    assert len(rows) >= 20, f"{page}: the settings table was not found ({rows})"
    wrong = [f"{name}: documented `{value}`, settings.py {as_documented(defaults[name])!r}"
             for name, value in rows if value != as_documented(defaults[name])]
    assert not wrong, f"{page} gives defaults that settings.py does not take: {wrong}"


def test_every_kiln_variable_the_code_reads_is_in_deployment_md():
    sources = [*(ROOT / "kiln_web").rglob("*.py"), *(ROOT / "trainer").rglob("*.py"),
               *(ROOT / "native_ext").glob("*.py"), *(ROOT / "native_ext").glob("*.h"), ROOT / "setup.py"]
    read = {name for path in sources for name in ENVIRON.findall(path.read_text(encoding="utf-8", errors="replace"))}
    read |= set(re.findall(r"getenv\(\"(KILN_[A-Z0-9_]+)\"\)", (ROOT / "native_ext" / "pool.h").read_text()))
    read |= {"KILN_CUDA_LIBRARY", "KILN_ONEDNN_LIBRARY", "KILN_CPU_GEMM"}  # named by a constant in their modules
    assert {"KILN_URL", "KILN_CPU_GEMM", "KILN_POOL_SPIN_US", "KILN_NVCC"} <= read
    test_only = {name for name in read if name.startswith("KILN_TEST_")}
    documentation = (ROOT / "docs" / "deployment.md").read_text()
    missing = sorted(name for name in read - test_only if f"`{name}`" not in documentation)
    assert not missing, f"docs/deployment.md does not document {missing}"
