"""What a non-editable ``pip install .`` puts in site-packages is the whole toolkit."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_source_folder_is_a_package_setup_py_will_find():
    """A folder of modules without ``__init__.py`` is skipped by find_packages (editable installs hide it)."""
    source = ROOT / "allreduce_kit"
    if not source.is_dir():
        pytest.skip("not run from a source checkout")
    for folder in source.rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
            assert (folder / "__init__.py").exists(), f"{folder.relative_to(ROOT)} has modules but no __init__.py"


def test_installed_package_has_the_cli_modules_and_kernels():
    import importlib

    for name in ("allreduce_kit.kernels", "allreduce_kit.train", "allreduce_kit.train.__main__", "allreduce_kit.bench"):
        importlib.import_module(name)


def test_every_doc_that_uses_plot_says_how_to_install_matplotlib():
    """``pip install .`` leaves matplotlib out (the ``plot`` extra): a page that shows ``--plot``
    says ``pip install ".[plot]"`` (or an install with that extra), as the CLIs' error does."""
    if not (ROOT / "docs").is_dir():
        pytest.skip("not run from a source checkout")
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        assert "allreduce_kit[plot]" not in text, f"{page.name}: the package is installed from its checkout, as .[plot]"
        if "--plot" in text:
            assert '".[plot]"' in text or '".[test,plot]"' in text, f"{page.name} shows --plot but not pip install \".[plot]\""
