"""The wheels a lent GPU machine needs to run the server, built here, checked here.

The device image (Python 3.12, manylinux x86_64, CUDA torch) has torch, numpy, scipy, httpx,
matplotlib, pytest and more (:data:`IMAGE`), but not fastapi, uvicorn, pydantic, pyhf,
jsonschema-rs, orjson and the rest of the server's needs, and it reaches no package registry.
This script resolves the server's requirements for that image: every requirement the image
lacks is downloaded as a cp312 manylinux (or pure-Python) wheel (of the version installed here,
the one the test suite ran, where it meets the requirement), its own requirements read
from the wheel's metadata and resolved the same way, and this repository is built into a
wheel of its own. ``--check`` installs a folder offline into a clean target (``pip install
--no-index``, for Python 3.12 on manylinux x86_64) and verifies that every requirement of
every wheel there is met by another wheel there or by the image.

    .venv/bin/python benchmarks/device_wheels.py --out .whl          # build (uses PyPI)
    .venv/bin/python benchmarks/device_wheels.py --check .whl        # offline install check

On the device: ``python3 -m pip install -q --no-index --no-deps --no-compile --target
/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site`` (``benchmarks/gpu_check.sh`` does it).
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]

#: The Python packages of the device image ('cuda'), as the device README lists them
#: (read on a machine running it, 2026-11-17): never carried.
IMAGE = frozenset(
    canonicalize_name(n)
    for n in [
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "botorch",
        "build",
        "certifi",
        "charset-normalizer",
        "chex",
        "click",
        "cloudpickle",
        "cmake",
        "colorama",
        "contourpy",
        "coverage",
        "cuda-bindings",
        "cuda-core",
        "cuda-pathfinder",
        "cuda-toolkit",
        "cupy-cuda13x",
        "cycler",
        "cython",
        "diffrax",
        "e3nn",
        "einops",
        "equinox",
        "etils",
        "execnet",
        "filelock",
        "flatbuffers",
        "flax",
        "fonttools",
        "formulaic",
        "frozenlist",
        "fsspec",
        "gpytorch",
        "grpcio",
        "h11",
        "h5py",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "humanize",
        "hypothesis",
        "idna",
        "imageio",
        "iniconfig",
        "interface-meta",
        "jax",
        "jax-cuda13-pjrt",
        "jax-cuda13-plugin",
        "jaxlib",
        "jaxtyping",
        "jinja2",
        "joblib",
        "kiwisolver",
        "lazy-loader",
        "lightning",
        "lightning-utilities",
        "linear-operator",
        "lineax",
        "llvmlite",
        "lxml",
        "markdown",
        "markdown-it-py",
        "markupsafe",
        "matplotlib",
        "mdurl",
        "meson",
        "ml-dtypes",
        "mpi4py",
        "mpmath",
        "msgpack",
        "multidict",
        "multipledispatch",
        "mypy-extensions",
        "nanobind",
        "narwhals",
        "networkx",
        "ninja",
        "numba",
        "numba-cuda",
        "numpy",
        "numpyro",
        "nvidia-cublas",
        "nvidia-cuda-cupti",
        "nvidia-cuda-nvrtc",
        "nvidia-cuda-runtime",
        "nvidia-cudnn-cu13",
        "nvidia-cufft",
        "nvidia-cufile",
        "nvidia-curand",
        "nvidia-cusolver",
        "nvidia-cusparse",
        "nvidia-cusparselt-cu13",
        "nvidia-ml-py",
        "nvidia-nccl-cu13",
        "nvidia-nvjitlink",
        "nvidia-nvshmem-cu13",
        "nvidia-nvtx",
        "onnx",
        "onnx-ir",
        "onnxruntime",
        "onnxscript",
        "opencv-python-headless",
        "optax",
        "opt-einsum",
        "opt-einsum-fx",
        "optimistix",
        "orbax-checkpoint",
        "packaging",
        "pandas",
        "pathspec",
        "patsy",
        "peft",
        "pillow",
        "pip",
        "pluggy",
        "portalocker",
        "prometheus-client",
        "propcache",
        "protobuf",
        "psutil",
        "pyarrow",
        "pybind11",
        "py-cpuinfo",
        "pygments",
        "pyparsing",
        "pyproject-hooks",
        "pyre-extensions",
        "pytest",
        "pytest-benchmark",
        "pytest-cov",
        "pytest-mock",
        "pytest-timeout",
        "pytest-xdist",
        "python-dateutil",
        "pytorch-lightning",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "sacrebleu",
        "safetensors",
        "scikit-build-core",
        "scikit-image",
        "scikit-learn",
        "scipy",
        "seaborn",
        "sentencepiece",
        "sentence-transformers",
        "setuptools",
        "shellingham",
        "simplejson",
        "six",
        "sortedcontainers",
        "statsmodels",
        "sympy",
        "tabulate",
        "tensorboard",
        "tensorboard-data-server",
        "tensorstore",
        "threadpoolctl",
        "tifffile",
        "tiktoken",
        "timm",
        "tokenizers",
        "toolz",
        "torch",
        "torchaudio",
        "torchdiffeq",
        "torch-geometric",
        "torchmetrics",
        "torchvision",
        "tqdm",
        "transformers",
        "treescope",
        "triton",
        "typer",
        "typing-extensions",
        "typing-inspect",
        "urllib3",
        "uvloop",
        "wadler-lindig",
        "werkzeug",
        "wheel",
        "wrapt",
        "xarray",
        "xxhash",
        "yarl",
        "zipp",
    ]
)

#: The environment markers of the device's Python (PEP 508).
MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}

#: pip's target options for that Python (manylinux tags are matched exactly, so several).
TARGET = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--abi",
    "cp312",
    *[
        arg
        for tag in ("2_28", "2_27", "2_24", "2_17", "2014", "1")
        for arg in ("--platform", f"manylinux{'_' if '_' in tag else ''}{tag}_x86_64")
    ],
]

#: What this repository's wheel is installed with there: the server (the device runs it).
EXTRAS = ("server",)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, stdout=subprocess.DEVNULL)


def requirements_of(wheel: Path, extras: tuple[str, ...] = ()) -> list[Requirement]:
    """A wheel's ``Requires-Dist`` that apply on the device (with ``extras`` asked for)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(name).decode())
    found = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        applies = requirement.marker is None or any(
            requirement.marker.evaluate({**MARKERS, "extra": extra}) for extra in ("", *extras)
        )
        if applies:
            found.append(requirement)
    return found


def _local_version(name: str) -> str | None:
    """The version installed beside this script (the one the test suite ran), if any."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _downloaded(folder: Path) -> dict[str, Path]:
    return {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in folder.glob("*.whl")}


def build(out: Path) -> list[str]:
    """Our wheel plus every wheel the device lacks for it into ``out``: problems, if any."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    _pip("wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO))
    ours = next(iter(_downloaded(out).values()))
    # breadth first, one pip call a level (a pip process a package took most of the time)
    pending = [(r, ours.name) for r in requirements_of(ours, EXTRAS)]
    asked: dict[str, list[tuple[Requirement, str]]] = {}
    have = _downloaded(out)
    while pending:
        specs: dict[str, str] = {}
        wanted: list[tuple[str, Requirement]] = []
        for requirement, by in pending:
            name = canonicalize_name(requirement.name)
            if name in IMAGE:
                continue
            asked.setdefault(name, []).append((requirement, by))
            if name in have or name in specs:
                continue
            spec = f"{requirement.name}{requirement.specifier}"
            local = _local_version(name)
            if local is not None and requirement.specifier.contains(local, prereleases=True):
                spec = f"{requirement.name}=={local}"  # the version tested here
            specs[name] = spec
            wanted.append((name, requirement))
        if specs:
            _pip("download", "--no-deps", "--quiet", *TARGET, "-d", str(out), *specs.values())
        have = _downloaded(out)
        pending = [
            (r, have[name].name)
            for name, requirement in wanted
            for r in requirements_of(have[name], tuple(requirement.extras))
        ]
    problems = []
    for name, wheel in _downloaded(out).items():
        version = parse_wheel_filename(wheel.name)[1]
        for requirement, by in asked.get(name, []):
            if not requirement.specifier.contains(version, prereleases=True):
                problems.append(f"{wheel.name} does not meet {requirement} (asked by {by})")
    return problems


def check(folder: Path) -> list[str]:
    """Install ``folder``'s wheels offline into a clean target for the device's Python, and
    list every requirement neither a wheel there nor the image meets."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return [f"no wheels in {folder}"]
    with tempfile.TemporaryDirectory() as target:
        _pip(
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-compile",
            *TARGET,
            "--target",
            target,
            *map(str, wheels),
        )
        installed = {
            canonicalize_name(p.name.split("-")[0]) for p in Path(target).glob("*.dist-info")
        }
    versions = {
        canonicalize_name(parse_wheel_filename(w.name)[0]): parse_wheel_filename(w.name)[1]
        for w in wheels
    }
    problems = [f"{n} is carried but did not install" for n in versions if n not in installed]
    ours = next((w for w in wheels if w.name.startswith("pyhf_gpu-")), None)
    if ours is None:
        problems.append("the repository's own wheel (pyhf_gpu-*.whl) is missing")
    for wheel in wheels:
        extras = EXTRAS if wheel is ours else ()
        for requirement in requirements_of(wheel, extras):
            name = canonicalize_name(requirement.name)
            if name in IMAGE:
                continue
            if name not in versions:
                problems.append(f"{wheel.name} needs {requirement}: neither carried nor there")
            elif not requirement.specifier.contains(versions[name], prereleases=True):
                problems.append(f"{wheel.name} needs {requirement}, carried {versions[name]}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="build the wheels into this folder")
    group.add_argument("--check", type=Path, help="check this folder offline")
    args = parser.parse_args()
    if args.out:
        problems = build(args.out) + check(args.out)
        folder = args.out
    else:
        problems, folder = check(args.check), args.check
    wheels = sorted(folder.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {folder}")
    for problem in problems:
        print("PROBLEM:", problem)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
