"""One version and one registry for everything a release publishes: the Python package
(pyproject.toml), the chart (version, appVersion, the operator image it defaults to), the CRD's
version annotation, the images the examples name and the commands docs/gke.md gives."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from diloco_operator.api import crdgen
from diloco_operator.api.release import release
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "diloco-operator"
VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
_REGISTRY = re.search(r"^REGISTRY \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
assert _REGISTRY is not None, "Makefile: REGISTRY ?= <where releases are pushed>"
REGISTRY = _REGISTRY.group(1)
IMAGE = re.compile(r"image: *(\S+)")


def test_the_installed_package_is_this_trees_version() -> None:
    assert release() == VERSION  # else: `make venv` (pyproject.toml changed)


def test_chart_version_app_version_and_default_image_are_the_release() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == VERSION and chart["appVersion"] == VERSION
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == f"{REGISTRY}/diloco-operator"


def test_the_crd_records_the_release() -> None:
    for path in (ROOT / "crds" / crdgen.CRD_FILE, CHART / "crds" / crdgen.CRD_FILE):
        notes = yaml.safe_load(path.read_text())["metadata"]["annotations"]
        assert notes[crdgen.VERSION_ANNOTATION] == VERSION, path


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=str)
def test_published_images_in_examples_are_of_this_release(example: Path) -> None:
    for image in IMAGE.findall(example.read_text()):
        if image.startswith(REGISTRY + "/"):
            assert image.rsplit(":", 1)[-1].startswith(VERSION), (example.name, image)
        else:  # a local build (kind, the real node), never a registry we do not publish to
            assert "/" not in image.split(":")[0] or image.startswith("localhost"), image


LOCKS = ROOT / "docker" / "locks"


def pins(lock: str) -> dict[str, str]:
    lines = (LOCKS / f"{lock}.txt").read_text().splitlines()
    pairs = (line.split("==", 1) for line in lines if line and not line.startswith("#"))
    return {canonicalize_name(name): version for name, version in pairs}


def requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = [r for extra in extras for r in project["optional-dependencies"][extra]]
    return [Requirement(r) for r in [*project["dependencies"], *named]]


@pytest.mark.parametrize(
    ("lock", "extras", "accelerator"),
    [
        ("cpu", ("trainer", "operator", "gcs"), None),
        ("tpu", ("trainer", "gcs"), "libtpu"),
        ("gpu", ("trainer", "gcs"), "jax-cuda12-plugin"),
    ],
)
def test_image_locks_pin_what_pyproject_asks_for(
    lock: str, extras: tuple[str, ...], accelerator: str | None
) -> None:
    """A lock older than a dependency's new floor (or a new dependency) would make the image
    build fail or drift: `make locks`."""
    pinned = pins(lock)
    for req in requirements(*extras):
        name = canonicalize_name(req.name)
        assert name in pinned, f"docker/locks/{lock}.txt lacks {req.name}: make locks"
        assert req.specifier.contains(pinned[name], prereleases=True), (lock, str(req))
    assert pinned["jax"] == pinned["jaxlib"]  # one JAX for every image
    assert pinned["jax"] == pins("cpu")["jax"]
    if accelerator is not None:
        assert accelerator in pinned


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "docker").glob("*.Dockerfile")), ids=str)
def test_every_image_installs_its_dependencies_under_a_lock(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    installs = re.findall(r"pip install (-c \S+ )?\"\.\[", text)
    assert installs and all(c for c in installs), dockerfile.name


def test_the_gke_guide_installs_this_release() -> None:
    guide = (ROOT / "docs" / "gke.md").read_text()
    assert f"export REPO={REGISTRY} TAG={VERSION}" in guide
    assert f"oci://{REGISTRY}/charts/diloco-operator --version $TAG" in guide


def test_the_readme_installs_this_release() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"oci://{REGISTRY}/charts/diloco-operator --version {VERSION}" in readme
