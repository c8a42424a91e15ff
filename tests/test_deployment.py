"""The deployment files: docker/Dockerfile, .dockerignore, compose.yaml, compose.cpu.yaml,
.env.example and docs/OPERATORS.md (see the last for how they are used).

No Docker is needed: the files are parsed and checked point by point. One slow test repeats the
image's install (same sources, non-editable, server extra, torch pinned to the one already there)
in a fresh virtualenv and runs the installed `pyhf-gpu-server --help`. One test hands both compose
variants to `docker compose config` where a Compose v2 is on PATH, and is skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "compose.yaml"
COMPOSE_CPU = ROOT / "compose.cpu.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
OPERATORS = ROOT / "docs" / "OPERATORS.md"

EXPECTED_CMD = ["pyhf-gpu-server", "--host", "0.0.0.0", "--device", "auto", "--data-dir", "/data"]
# The server's settings, read from the environment (and so from .env through compose).
SERVER_ENV = (
    "PYHF_GPU_API_TOKEN",
    "PYHF_GPU_DEVICE",
    "PYHF_GPU_DTYPE",
    "PYHF_GPU_DATA_DIR",
    "PYHF_GPU_MAX_BODY_MB",
    "PYHF_GPU_MAX_BATCH_SIZE",
    "PYHF_GPU_MAX_BATCH_DELAY_MS",
    "PYHF_GPU_MAX_QUEUE",
    "PYHF_GPU_MODEL_CACHE_SIZE",
    "PYHF_GPU_RESULT_TTL_HOURS",
    "PYHF_GPU_LOG_LEVEL",
)
PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
# How the Dockerfile reads the installed torch's version, to pin the install to it.
TORCH_VERSION = "from importlib.metadata import version; print(version('torch'))"


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments and blank lines, also inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        logical = pending + line
        pending = ""
        keyword, _, args = logical.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def args_of(instructions: list[tuple[str, str]], keyword: str) -> list[str]:
    return [args for kw, args in instructions if kw == keyword]


def strip_flags(args: str) -> tuple[dict[str, str], str]:
    """Split leading `--name=value` options from an instruction's arguments."""
    flags: dict[str, str] = {}
    rest = args
    while rest.startswith("--"):
        token, _, rest = rest.partition(" ")
        name, _, value = token[2:].partition("=")
        flags[name] = value
        rest = rest.strip()
    return flags, rest


def resolved_base_image(instructions: list[tuple[str, str]]) -> str:
    """The FROM image with the ARG defaults declared before it substituted."""
    defaults: dict[str, str] = {}
    for keyword, args in instructions:
        if keyword == "ARG":
            name, _, value = args.partition("=")
            defaults[name.strip()] = value.strip().strip("\"'")
        elif keyword == "FROM":
            _, image = strip_flags(args)
            image = image.split()[0]
            return re.sub(
                r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m.group(1) or m.group(2)], image
            )
    raise AssertionError("no FROM in the Dockerfile")


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_base_image_is_a_pinned_official_cuda_pytorch_runtime(instructions):
    froms = args_of(instructions, "FROM")
    assert len(froms) == 1, "one stage: the runtime image is the base image"
    image = resolved_base_image(instructions)
    match = re.fullmatch(
        r"pytorch/pytorch:(?P<torch>\d+\.\d+\.\d+)-cuda(?P<cuda>\d+\.\d+)-cudnn\d+-runtime", image
    )
    assert match, f"not a pinned pytorch/pytorch CUDA runtime tag: {image}"
    # Its torch must satisfy the package's range, or pip would pull another torch.
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([\d.]+)"', pyproject)
    assert floor, "pyproject.toml: the server extra has no `torch>=` floor"
    assert version_tuple(match["torch"]) >= version_tuple(floor.group(1))


def test_installs_the_package_with_its_serving_extras_from_the_copied_source(instructions):
    runs = " ".join(args_of(instructions, "RUN"))
    install = re.search(r"pip install (?P<args>[^&;]*)", runs)
    assert install, "no `pip install` in the Dockerfile"
    args = install["args"]
    extras = re.search(r"""["']?\.\[([\w,]+)\]["']?""", args)
    assert extras, args
    # the image serves plots and runs cluster workers too: every extra the package has but
    # the adapters' and the tests'
    named = set(extras.group(1).split(","))
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    covered = set().union(
        *(
            {extra, *re.findall(r"pyhf-gpu\[([\w,]+)\]", " ".join(optional[extra]))[0].split(",")}
            if any("pyhf-gpu[" in d for d in optional[extra])
            else {extra}
            for extra in named
        )
    )
    assert {"server", "plots", "cluster"} <= covered, named
    assert "-e " not in f"{args} " and "--editable" not in args, "the image needs a regular install"
    # torch comes from the base image only: never installed by name, pinned for the install.
    tokens = shlex.split(args)
    assert not [t for t in tokens if re.fullmatch(r"torch([=<>!~\[].*)?", t)], tokens
    assert "--constraint" in tokens or "-c" in tokens
    assert "torch==" in runs


def test_copied_sources_exist_and_pass_the_dockerignore(instructions):
    sources = []
    for args in args_of(instructions, "COPY"):
        flags, rest = strip_flags(args)
        assert "from" not in flags, "single-stage build: COPY only from the context"
        sources += rest.split()[:-1]
    assert {"pyproject.toml", "client", "server"} <= set(sources), sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: missing in the repository"
        assert not dockerignored(source), f"COPY {source}: left out by .dockerignore"
    for module in ("server/__init__.py", "client/__init__.py"):
        assert not dockerignored(module)


def test_runs_as_a_non_root_user_that_owns_data(instructions):
    users = args_of(instructions, "USER")
    assert users, "no USER: the server would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    # The last USER comes after the install and is the one the CMD runs as.
    keywords = [kw for kw, _ in instructions]
    assert keywords.index("CMD") > len(keywords) - 1 - keywords[::-1].index("USER")
    runs = " ".join(args_of(instructions, "RUN"))
    creates = re.search(r"useradd[^&;]*--uid[ =](\d+)[^&;]*?\s(\w+)\s*(?:&&|$)", runs)
    assert creates, "the user is not created with a fixed UID"
    uid, name = creates.groups()
    assert user in {uid, name}
    assert "mkdir -p /data" in runs
    chown = re.search(r"chown\s+(\S+)\s+/data\b", runs)
    assert chown, "/data is not handed to the user"
    assert chown.group(1).split(":")[0] in {uid, name}


def test_healthcheck_probes_healthz_without_curl(instructions):
    checks = args_of(instructions, "HEALTHCHECK")
    assert len(checks) == 1
    flags, rest = strip_flags(checks[0])
    assert {"interval", "timeout", "retries"} <= flags.keys()
    assert rest.startswith("CMD ")
    probe = json.loads(rest[len("CMD ") :])
    assert probe[:2] == ["python", "-c"]
    assert "urllib.request" in probe[2]
    assert "http://127.0.0.1:8000/healthz" in probe[2]


def test_exposes_8000(instructions):
    assert args_of(instructions, "EXPOSE") == ["8000"]


def test_cmd_starts_the_server_on_all_interfaces_with_auto_device_and_data_dir(instructions):
    cmds = args_of(instructions, "CMD")
    assert len(cmds) == 1
    assert json.loads(cmds[0]) == EXPECTED_CMD  # exec form, so signals reach the server
    assert not args_of(instructions, "ENTRYPOINT")


# --------------------------------------------------------------------------- .dockerignore


def _glob_to_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex (Go filepath.Match syntax plus `**`)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            body = pattern[i + 1 : end]
            out += "[" + ("^" + body[1:] if body.startswith(("!", "^")) else body) + "]"
            i = end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str) -> bool:
    """Whether the builder leaves `path` (relative to the context) out: the last pattern that
    matches the path or one of its parent directories decides; `!` lets a path back in."""
    excluded = False
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        regex = _glob_to_regex(line.lstrip("!").strip().strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def dockerignored_in(directory: str, name: str) -> bool:
    """dockerignored() for a file met while copying the repository tree."""
    return dockerignored(str((Path(directory) / name).relative_to(ROOT)))


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/HEAD",
        ".env",
        "tests/test_deployment.py",
        "benchmarks/results.json",
        "docs/OPERATORS.md",
        "build/lib/x.py",
        "pyhf_gpu.egg-info/PKG-INFO",
        ".pytest_cache/v/cache",
        ".ruff_cache/x",
        "server/__pycache__/x.cpython-311.pyc",
        "server/engine/__pycache__/x.pyc",
        "server/jobs.sqlite3",
        "jobs.sqlite3",
    ],
)
def test_dockerignore_keeps_the_context_small(path):
    assert DOCKERIGNORE.is_file()
    assert dockerignored(path), f"{path} would be sent to the builder"


# --------------------------------------------------------------------------- compose


class ComposeTag:
    """A Compose YAML tag (`!reset`, `!override`) with its value."""

    def __init__(self, tag: str, value):
        self.tag, self.value = tag, value

    def __repr__(self) -> str:
        return f"{self.tag} {self.value!r}"


class ComposeLoader(yaml.SafeLoader):
    pass


def _construct_tag(loader: yaml.SafeLoader, node: yaml.Node) -> ComposeTag:
    if isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    elif isinstance(node, yaml.MappingNode):
        value = loader.construct_mapping(node, deep=True)
    else:
        value = loader.construct_scalar(node)
    return ComposeTag(node.tag, value)


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, _construct_tag)


def load_compose(path: Path) -> dict:
    with path.open() as fh:
        return yaml.load(fh, Loader=ComposeLoader)  # a SafeLoader that knows !reset/!override


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose(COMPOSE)


@pytest.fixture(scope="module")
def server(compose) -> dict:
    assert set(compose["services"]) == {"server"}
    return compose["services"]["server"]


def interpolate_defaults(value: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR-default}` / `${VAR}` with no variable set."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def test_compose_builds_the_image_from_the_repository_root(server):
    assert server["build"]["context"] == "."
    assert server["build"]["dockerfile"] == "docker/Dockerfile"
    assert (ROOT / server["build"]["dockerfile"]).is_file()


def test_compose_command_matches_the_image_cmd(server, instructions):
    command = [interpolate_defaults(str(part)) for part in server.get("command", EXPECTED_CMD)]
    assert command == json.loads(args_of(instructions, "CMD")[0])


def test_compose_publishes_8000(server):
    targets = []
    for port in server["ports"]:
        if isinstance(port, dict):
            targets.append(int(port["target"]))
        else:
            targets.append(int(interpolate_defaults(str(port)).rsplit(":", 1)[-1]))
    assert 8000 in targets


def test_compose_reserves_an_nvidia_gpu(server):
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert isinstance(devices, list) and len(devices) == 1
    (device,) = devices
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]
    assert device.get("count") in (1, "all") or device.get("device_ids")


def test_compose_keeps_the_job_store_in_a_named_volume_at_data(compose, server):
    named = set(compose.get("volumes") or {})
    mounts = {}
    for volume in server["volumes"]:
        if isinstance(volume, dict):
            if volume.get("type", "volume") == "volume":
                mounts[volume["target"]] = volume["source"]
        else:
            source, target = volume.split(":")[:2]
            mounts[target] = source
    assert "/data" in mounts, server["volumes"]
    assert mounts["/data"] in named, "/data must be a named volume, not a bind mount"
    # A fixed project name keeps the volume's name (<project>_<volume>) across checkouts.
    assert compose.get("name")


def test_compose_restarts_and_checks_health(server):
    assert server["restart"] == "unless-stopped"
    check = server["healthcheck"]
    assert not check.get("disable")
    test = check["test"]
    joined = test if isinstance(test, str) else " ".join(test)
    assert "http://127.0.0.1:8000/healthz" in joined
    if not isinstance(test, str):
        assert test[0] in ("CMD", "CMD-SHELL")


def test_compose_reads_token_and_limits_from_an_optional_env_file(server):
    env_files = server["env_file"]
    env_files = [env_files] if isinstance(env_files, (str, dict)) else env_files
    entries = [e if isinstance(e, dict) else {"path": e} for e in env_files]
    dotenv = [e for e in entries if e["path"] in (".env", "./.env")]
    assert dotenv, "the service does not read .env"
    assert dotenv[0].get("required") is False, "`docker compose up` must work without a .env"
    # The job store location is fixed by the volume, whatever .env says.
    assert server["environment"]["PYHF_GPU_DATA_DIR"] == "/data"


def test_env_example_documents_every_setting(compose):
    text = ENV_EXAMPLE.read_text()
    for name in SERVER_ENV:
        assert re.search(rf"^#?\s*{name}\b", text, re.M), f".env.example: {name} missing"
    # Every ${VAR} that compose.yaml interpolates can be set from .env.
    used = set(re.findall(r"\$\{(\w+)", COMPOSE.read_text()))
    for name in used:
        assert re.search(rf"^#?\s*{name}=", text, re.M), f".env.example: {name} missing"
    # Values that are set (not commented out) parse as KEY=VALUE.
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert re.fullmatch(r"[A-Z][A-Z0-9_]*=\S*", line), line


def test_env_example_covers_every_server_setting():
    settings = pytest.importorskip("pyhf_gpu_server.service.settings")
    text = ENV_EXAMPLE.read_text()
    for field in settings.Settings.model_fields:
        name = settings.env_name(field)
        assert re.search(rf"^#?\s*{name}\b", text, re.M), f".env.example: {name} missing"


def test_compose_waits_longer_than_the_server_s_graceful_shutdown(server):
    settings = pytest.importorskip("pyhf_gpu_server.service.settings")
    fields = settings.Settings.model_fields
    if "graceful_timeout_s" not in fields:
        pytest.skip("the server has no graceful_timeout_s setting")
    match = re.fullmatch(r"(\d+)s", str(server["stop_grace_period"]))
    assert match, server["stop_grace_period"]
    assert int(match.group(1)) > fields["graceful_timeout_s"].default


def test_compose_fixes_port_and_data_dir_over_the_env_file(server):
    # `environment` wins over `env_file`: .env cannot move the port the healthcheck probes.
    assert str(server["environment"]["PYHF_GPU_PORT"]) == "8000"
    assert server["environment"]["PYHF_GPU_DATA_DIR"] == "/data"


def _git(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def test_dotenv_is_ignored_by_git_and_the_example_is_not():
    assert ENV_EXAMPLE.is_file()
    assert _git("check-ignore", "-q", ".env").returncode == 0, ".env must be git-ignored"
    assert _git("check-ignore", "-q", ".env.example").returncode == 1


def test_cpu_variant_only_drops_the_gpu(server):
    cpu = load_compose(COMPOSE_CPU)
    assert set(cpu) == {"services"}, "an override file: no volumes, name or other services"
    assert set(cpu["services"]) == {"server"}
    override = cpu["services"]["server"]
    # Everything but the device comes from compose.yaml.
    assert set(override) <= {"command", "deploy", "environment"}, set(override)
    devices = override["deploy"]["resources"]["reservations"]["devices"]
    assert isinstance(devices, ComposeTag) and devices.tag == "!reset", devices
    command = [str(part) for part in override["command"]]
    expected = [interpolate_defaults(str(part)) for part in server["command"]]
    expected[expected.index("--device") + 1] = "cpu"
    assert command == expected


def test_operator_docs_cover_the_essentials():
    text = OPERATORS.read_text()
    for needle in (
        "NVIDIA Container Toolkit",
        "docker compose up -d",
        "/info",
        "Authorization: Bearer",
        ".env",
        "/data",
        "docker compose build --pull",
        "/metrics",
        "pyhf_gpu_batch_size",
        "compose.cpu.yaml",
    ):
        assert needle in text, f"docs/OPERATORS.md: nothing on {needle!r}"


def test_cluster_compose_runs_a_scheduler_the_api_node_and_gpu_workers():
    cluster = load_compose(ROOT / "compose.cluster.yaml")
    services = cluster["services"]
    assert cluster["name"] == load_compose(COMPOSE)["name"], "same project: the same job store"
    workers = {name: s for name, s in services.items() if name.startswith("worker")}
    assert {"scheduler", "server"} <= set(services) and len(workers) >= 2
    # the scheduler
    scheduler = services["scheduler"]
    assert [str(p) for p in scheduler["command"][:2]] == ["dask", "scheduler"]
    assert "8786" in [str(p) for p in scheduler["command"]]
    # the API node: the image's server in cluster mode, the data volume, no GPU
    api = services["server"]
    assert api["build"]["dockerfile"] == "docker/Dockerfile"
    command = [str(p) for p in api["command"]]
    assert command[0] == "pyhf-gpu-server"
    address = command[command.index("--dask-scheduler") + 1]
    assert address == "tcp://scheduler:8786"
    assert api["environment"]["PYHF_GPU_DASK_SCHEDULER"] == address
    assert api["environment"]["PYHF_GPU_DATA_DIR"] == "/data"
    assert [v.split(":")[1] for v in api["volumes"]] == ["/data"]
    assert api["volumes"][0].split(":")[0] in cluster["volumes"], "a named volume"
    assert "deploy" not in api, "the API node reserves no GPU"
    assert api["depends_on"]["scheduler"]["condition"] == "service_healthy"
    # the workers: one GPU each (distinct cards), the same scheduler, no data volume
    cards = []
    for name, worker in workers.items():
        command = [str(p) for p in worker["command"]]
        assert command[:2] == ["pyhf-gpu-worker", address], name
        assert command[command.index("--device") + 1].startswith("cuda"), name
        (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert len(device["device_ids"]) == 1 and "count" not in device, name
        cards.append(device["device_ids"][0])
        assert "volumes" not in worker, f"{name}: the data volume belongs to the API node"
        assert worker["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert len(set(cards)) == len(cards), "two workers on one GPU"
    # every service checks its health over HTTP and restarts
    ports = {
        "scheduler": "8787/health",
        "server": "8000/healthz",
        **dict.fromkeys(workers, "8789/health"),
    }
    for name, probe in ports.items():
        service = services[name]
        assert service["restart"] == "unless-stopped", name
        test = " ".join(str(p) for p in service["healthcheck"]["test"])
        assert f"http://127.0.0.1:{probe}" in test, name
    worker_http = [str(p) for p in next(iter(workers.values()))["command"]]
    assert worker_http[worker_http.index("--http-address") + 1] == ":8789"
    used = set(re.findall(r"\$\{(\w+)", (ROOT / "compose.cluster.yaml").read_text()))
    text = ENV_EXAMPLE.read_text()
    for name in used:
        assert re.search(rf"^#?\s*{name}=", text, re.M), f".env.example: {name} missing"


# --------------------------------------------------------------------------- with tools


def _compose_v2() -> list[str] | None:
    """A Docker Compose v2 command on PATH (plugin or standalone), or None."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        try:
            out = subprocess.run(
                [*command, "version", "--short"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        version = re.match(r"v?(\d+\.\d+\.\d+)", out.stdout.strip())
        if out.returncode == 0 and version and version_tuple(version.group(1)) >= (2, 24, 4):
            return command
    return None


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_docker_compose_accepts_both_variants(variant, tmp_path):
    command = _compose_v2()
    if command is None:
        pytest.skip("no Docker Compose >= 2.24.4 on PATH")
    files = ["-f", str(COMPOSE)] + (["-f", str(COMPOSE_CPU)] if variant == "cpu" else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "PYHF_GPU_"))}
    out = subprocess.run(
        [*command, *files, "--env-file", os.devnull, "config", "--format", "json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    server = config["services"]["server"]
    devices = server.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    if variant == "gpu":
        assert devices and devices[0]["driver"] == "nvidia"
        assert server["command"][server["command"].index("--device") + 1] == "auto"
    else:
        assert not devices
        assert server["command"][server["command"].index("--device") + 1] == "cpu"
    assert [v["target"] for v in server["volumes"]] == ["/data"]
    assert config["volumes"][server["volumes"][0]["source"]]["name"] == "pyhf-gpu_data"
    assert server["restart"] == "unless-stopped"


def _clean_env() -> dict[str, str]:
    """The environment without the test run's virtualenv leaking into the new one."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE"}
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs
    )
    assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_image_install_gives_a_working_server_cli(tmp_path, instructions):
    """What `docker build` does, without Docker: the sources the Dockerfile COPYs, a torch that
    is already there (here the CPU build, in the image the CUDA one), then a regular install of
    the package with the Dockerfile's extras pinned to that torch, then the CMD's program.

    The new environment sees the packages this run has (torch, and the other dependencies:
    symlinks behind a ``.pth``, without this checkout's own pyhf-gpu), as the image sees its
    torch: pip checks every requirement of the extras against them (a missing one would be
    installed from the index) and installs the package itself from the copied sources. That
    the dependencies install offline into a clean place is tested apart
    (``test_gpu_check.py``)."""
    extras = re.search(r'"\.\[([\w,]+)\]"', " ".join(args_of(instructions, "RUN")))
    assert extras, "the Dockerfile installs no `.[extras]`"
    context = tmp_path / "context"
    context.mkdir()
    for args in args_of(instructions, "COPY"):
        for source in strip_flags(args)[1].split()[:-1]:
            src, dst = ROOT / source, context / source
            assert src.exists(), f"COPY {source}: missing in the repository"
            if src.is_dir():
                shutil.copytree(
                    src, dst, ignore=lambda d, names: [n for n in names if dockerignored_in(d, n)]
                )
            else:
                shutil.copy2(src, dst)

    venv = tmp_path / "venv"
    env = _clean_env()
    _run([sys.executable, "-m", "venv", venv], timeout=120, env=env)
    python = venv / "bin" / "python"
    # --no-compile: the installs' bytecode is no part of what is tested (a minute of CPU here)
    install = [python, "-m", "pip", "install", "--quiet", "--no-compile"]
    packages = tmp_path / "packages"
    packages.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        if not entry.name.startswith(("pyhf_gpu", "__editable__")) and entry.suffix != ".pth":
            (packages / entry.name).symlink_to(entry)
    site = _run([python, "-c", PURELIB], timeout=120, env=env).stdout.strip()
    (Path(site) / "_packages_there.pth").write_text(f"{packages}\n")
    torch_version = _run([python, "-c", TORCH_VERSION], timeout=120, env=env).stdout.strip()
    constraint = tmp_path / "torch-constraint.txt"
    constraint.write_text(f"torch=={torch_version}\n")
    _run(
        [*install, "--constraint", constraint, f"{context}[{extras.group(1)}]"],
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    # A regular install, not a link back to the sources; the torch is still the one from before.
    show = _run([python, "-m", "pip", "show", "-f", "pyhf-gpu"], timeout=60, env=env).stdout
    assert "Editable project location" not in show
    after = _run([python, "-c", TORCH_VERSION], timeout=120, env=env)
    assert after.stdout.strip() == torch_version

    server_cli = venv / "bin" / "pyhf-gpu-server"
    assert server_cli.is_file(), "the server extra installs no pyhf-gpu-server script"
    help_out = subprocess.run(
        [str(server_cli), "--help"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert help_out.returncode == 0, help_out.stderr[-3000:]
    flags = [part for part in json.loads(args_of(instructions, "CMD")[0]) if part.startswith("--")]
    assert {"--device", "--data-dir"} <= set(flags)
    for flag in flags:
        assert flag in help_out.stdout, f"`pyhf-gpu-server --help` does not mention {flag}"
