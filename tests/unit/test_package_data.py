"""What a wheel ships beside the code (pyproject.toml's package-data) is where the code
reads it: the console's static page moved with the admin package once, and only an
editable install still found it."""

from __future__ import annotations

from pathlib import Path

import tomllib

from services.gateway.admin import console_api

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_data_glob_matches_files_of_a_real_package():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    for package, globs in data.items():
        folder = ROOT / package.replace(".", "/")
        assert (folder / "__init__.py").exists(), package
        for pattern in globs:
            assert list(folder.glob(pattern)), (package, pattern)


def test_the_console_is_read_from_the_shipped_folder():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    shipped = {ROOT / p.replace(".", "/") / g.split("/")[0]
               for p, globs in data.items() for g in globs}
    assert console_api.STATIC.resolve() in {s.resolve() for s in shipped}
