"""The version tunekit reports is the one pyproject.toml packages."""

import tomllib

from conftest import ROOT
from tunekit.core.version import VERSION


def test_the_version_is_pyprojects():
    import tunekit

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert VERSION == project["version"] == tunekit.__version__
