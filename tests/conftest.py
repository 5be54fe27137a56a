"""Shared by every test folder; keep it small, fixtures belong in each subfolder's conftest.py.

KILN_HOME is set to a fresh temporary folder by kiln_web/pytest_plugin.py (loaded with
`-p` from pyproject.toml), because pytest-django loads the settings before this file.
"""
