"""Debian packages as offline data: `apt-get download` (nothing is installed) and `dpkg-deb -x`,
once, into a cache directory. The offline datasets (`offline_de_en`, `offline_help_topics`,
`offline_fashion_mnist`) are built from what this unpacks.

It needs Debian package lists (`apt-get update`, once, as root) and a route to a mirror. Without
them, `PackagesUnavailable` says so in one line, with the dataset's alternative.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import subprocess


class PackagesUnavailable(ValueError):
    """apt cannot fetch the packages (no apt, no package lists, no route to the mirror). A
    ValueError, like other bad settings, so train.py prints its one line."""


@dataclasses.dataclass(frozen=True)
class Package:
    name: str
    version: str
    deb: str  # file name of the .deb
    sha256: str


def _find_debs(directory: str, names: tuple[str, ...]) -> dict[str, str]:
    found = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.deb"))):
        name = os.path.basename(path).split("_")[0]
        if name in names:
            found[name] = path
    return found


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch(cache_dir: str, names: tuple[str, ...], *, dataset: str,
          alternative: str) -> tuple[str, list[Package]]:
    """Downloads (once) and unpacks the packages `names` under `cache_dir`. Returns the unpacked
    root and the packages. `dataset` and `alternative` ("or ...") word the one-line error."""
    root = os.path.join(cache_dir, "root")
    manifest = os.path.join(cache_dir, "packages.json")
    if os.path.exists(manifest) and os.path.isdir(root):
        with open(manifest) as f:
            return root, [Package(**p) for p in json.load(f)]
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise PackagesUnavailable(
                f"{dataset} is built from Debian packages with apt-get and dpkg-deb, and "
                f"`{tool}` is not found here: build it on a Debian or Ubuntu machine (with "
                f"`apt-get update` run once as root) and copy the TFDS data_dir, {alternative}")
    debs_dir = os.path.join(cache_dir, "debs")
    os.makedirs(debs_dir, exist_ok=True)
    debs = _find_debs(debs_dir, names)
    if len(debs) < len(names):
        result = subprocess.run(["apt-get", "download", *names], cwd=debs_dir,
                                capture_output=True, text=True)
        debs = _find_debs(debs_dir, names)
        if result.returncode or len(debs) < len(names):
            lines = [ln for ln in result.stderr.splitlines() if ln.startswith("E:")]
            if any("Unable to locate" in ln for ln in lines):
                problem = "apt has no package lists here"
            else:
                problem = f"`apt-get download` failed ({lines[0] if lines else result.returncode})"
            raise PackagesUnavailable(
                f"{dataset} is built from Debian packages, but {problem}: run "
                f"`apt-get update` as root (once), {alternative}")
    staging = root + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    packages = []
    for name in names:
        deb = debs[name]
        subprocess.run(["dpkg-deb", "-x", deb, staging], check=True, capture_output=True)
        version = subprocess.run(["dpkg-deb", "-f", deb, "Version"], check=True,
                                 capture_output=True, text=True).stdout.strip()
        packages.append(Package(name, version, os.path.basename(deb), _sha256(deb)))
    shutil.rmtree(root, ignore_errors=True)
    os.replace(staging, root)
    with open(manifest, "w") as f:
        json.dump([dataclasses.asdict(p) for p in packages], f, indent=1)
    return root, packages


def copy_licences(root: str, names: tuple[str, ...], directory: str) -> None:
    """Copies each unpacked package's `usr/share/doc/<name>/copyright` that exists to
    `<directory>/licenses/<name>.copyright` (a TFDS dataset keeps its licences beside it)."""
    licences = os.path.join(directory, "licenses")
    os.makedirs(licences, exist_ok=True)
    for name in names:
        path = os.path.join(root, "usr/share/doc", name, "copyright")
        if os.path.exists(path):
            shutil.copyfile(path, os.path.join(licences, f"{name}.copyright"))


def unpacked_root(dl_manager, names: tuple[str, ...], *, cache: str, marker: str, dataset: str,
                  alternative: str) -> tuple[str, list[dict]]:
    """For a TFDS builder: a manual_dir's unpacked tree when it holds `marker` (a path inside
    the tree; the tests' fixtures), else `fetch` into `<download_dir>/<cache>`. Returns the root
    and the packages' records."""
    try:
        manual = os.fspath(dl_manager.manual_dir)
    except (AssertionError, ValueError):  # no manual_dir given, or it is empty
        manual = None
    if manual is not None and os.path.exists(os.path.join(manual, marker)):
        return manual, [{"name": "manual_dir", "source": manual}]
    root, packages = fetch(os.path.join(os.fspath(dl_manager.download_dir), cache), names,
                           dataset=dataset, alternative=alternative)
    return root, [dataclasses.asdict(p) for p in packages]
