"""The distribution as a packager builds it: ``python -m build`` makes a wheel and an
sdist that ``twine check --strict`` passes, with the licence in both, and the wheel
installed into a fresh virtual environment gives ``import gpumagic``, the pytest plugin
and ``%load_ext gpumagic``.

The fresh environment gets the wheel alone (``--no-deps``, nothing downloaded); its
dependencies (torch, IPython, pytest, line_profiler) come from this environment's
site-packages, read through a ``.pth`` line, which does not carry this checkout's
editable install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.xdist_group("packaging")


def run(*args: str | Path, cwd: Path = ROOT) -> str:
    # Without PYTHONPATH: a checkout's src/ on it (PYTHONPATH=src) would stand in for
    # the installed wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, check=False, env=env
    )
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _project_urls(metadata: str) -> dict[str, str]:
    """The ``Project-URL`` fields of a distribution's metadata, by label."""
    from email.parser import Parser

    fields = Parser().parsestr(metadata, headersonly=True).get_all("Project-URL") or []
    return dict(field.split(", ", 1) for field in fields)


def _declared_urls() -> dict[str, str]:
    import tomllib

    urls: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    return urls


def test_build_check_and_install_the_wheel(tmp_path: Path) -> None:
    pytest.importorskip("build")
    pytest.importorskip("twine")
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT)
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist)
    assert any(n.endswith("licenses/LICENSE") for n in zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert any(n.endswith("/LICENSE") for n in names)
    assert not any("/tests/" in n for n in names)  # all of the suite or none of it
    # Where the project lives, in both (issue 39: no URL anywhere before).
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        wheel_urls = _project_urls(archive.read(metadata).decode())
    with tarfile.open(sdist) as archive:
        (pkg_info,) = (
            m
            for m in archive.getmembers()
            if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")
        )
        extracted = archive.extractfile(pkg_info)
        assert extracted is not None
        sdist_urls = _project_urls(extracted.read().decode())
    assert wheel_urls == sdist_urls == _declared_urls()
    assert {"Homepage", "Documentation", "Source", "Changelog"} <= set(wheel_urls)

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel)
    fresh = Path(
        run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    )
    (fresh / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = run(
        python, "-c", "import gpumagic, pytest_cuda; print(gpumagic.__file__)", cwd=tmp_path
    )
    assert where.startswith(str(fresh)), where
    help_text = run(python, "-m", "pytest", "--help", "-p", "no:cacheprovider", cwd=tmp_path)
    assert "--cuda-leak-check" in help_text
    loaded = run(
        python,
        "-c",
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'gpumagic')\n"
        "print(sorted(n for n in ip.magics_manager.magics['line'] if n in "
        "('cudatime', 'gpumem', 'lprun')))\n",
        cwd=tmp_path,
    )
    assert loaded.strip() == "['cudatime', 'gpumem', 'lprun']"


def test_make_test_oldest_pins_the_declared_floors() -> None:
    """``make test-oldest`` runs on exactly the floors pyproject.toml declares (torch
    aside: its floor has no CPU wheel here, as the Makefile says)."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    floors = {}
    for requirement in requirements:
        found = re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement)
        if found:
            floors[found.group(1).lower().replace("_", "-")] = found.group(2)
    makefile = (ROOT / "Makefile").read_text()
    block = makefile.split("OLDEST :=", 1)[1].split("\ntest-oldest:", 1)[0]
    pins = {
        name.lower().replace("_", "-"): version
        for name, version in re.findall(r"([A-Za-z0-9_.-]+)==([0-9.]+)", block)
    }
    for name in ("pytest", "ipython", "line-profiler", "nvidia-ml-py", "pytest-xdist"):
        floor, pin = floors[name], pins[name]
        assert pin == floor or pin.startswith(floor + "."), (name, floor, pin)


def test_metadata_says_what_the_package_is_for() -> None:
    """PyPI's filters: a development status, the operating system, topics (issue 29)."""
    import tomllib

    classifiers = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["classifiers"]
    for prefix in ("Development Status :: ", "Operating System :: ", "Topic :: "):
        assert any(c.startswith(prefix) for c in classifiers), prefix


def test_the_readme_states_the_declared_floors() -> None:
    """The README's requirements sentence names the floors pyproject.toml declares (it
    said line_profiler 5 where the floor is 5.1; issue 29)."""
    import re
    import tomllib

    readme = " ".join((ROOT / "README.md").read_text().split())
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {d.split(">=")[0]: d.split(">=")[1].split(",")[0] for d in dependencies}
    for name, shown in (
        ("torch", "torch"),
        ("ipython", "IPython"),
        ("line_profiler", "line_profiler"),
    ):
        floor = re.sub(r"(\.0)+$", "", floors[name])
        assert re.search(rf"\b{shown} {re.escape(floor)}\b(?!\.)", readme), (name, floor)


def test_the_readme_links_the_project_urls() -> None:
    """The README (the sdist's and the wheel's description too) links the repository,
    the docs and the changelog that ``[project.urls]`` declares, as absolute links: a
    relative one names nothing on an index's page (issue 39)."""
    readme = (ROOT / "README.md").read_text()
    urls = _declared_urls()
    for label in ("Source", "Documentation", "Changelog"):
        assert urls[label].startswith("https://"), (label, urls[label])
        assert urls[label] in readme, label


def test_the_readme_installs_torch_before_the_package() -> None:
    """The README gives PyTorch's CPU-only and CUDA install commands before
    ``pip install .``, which would otherwise take a CUDA torch from PyPI (issue 39)."""
    readme = (ROOT / "README.md").read_text()
    cpu = readme.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    cuda = readme.index("pip install torch --index-url https://download.pytorch.org/whl/cu1")
    assert max(cpu, cuda) < readme.index("pip install .\n")
    # The quickstart's "two commands do it all" stays.
    assert "make demo    # sets itself up" in readme
    assert "make test    # sets itself up" in readme
