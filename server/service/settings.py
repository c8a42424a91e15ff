"""Service settings: one immutable object, read from the command line and ``PYHF_GPU_*`` variables.

Nothing here is process-wide: :func:`pyhf_gpu_server.service.app.create_app` receives a
:class:`Settings` and everything (device, dtype, limits) flows from it to the parts that need it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "PYHF_GPU_"
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("float64", "float32")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_CALLER = "default"
"""The caller's name when the server has one token (``--api-token``, or a one-token file)."""


def default_local_workers() -> int:
    """One local worker per core beyond the first, at most 4 (``--local-workers -1``)."""
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/pyhf-gpu`` (``~/.local/share/pyhf-gpu`` when unset)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pyhf-gpu"


@dataclass(frozen=True, repr=False)
class Callers:
    """Who may call the API: each Bearer token names one caller (token -> name).

    Built from ``--api-token`` (one caller, :data:`DEFAULT_CALLER`) or from the ``NAME TOKEN``
    lines of ``--api-token-file`` (``dependencies.parse_token_file``). Names and tokens are
    unique; tokens never show in ``repr``.
    """

    entries: tuple[tuple[str, str], ...]
    """``(name, token)`` pairs."""

    def __post_init__(self) -> None:
        """Refuse an empty table, empty names or tokens, and repeated names or tokens."""
        names = [name for name, _ in self.entries]
        tokens = [token for _, token in self.entries]
        if not self.entries:
            raise ValueError("no API token given")
        if not all(names) or not all(tokens):
            raise ValueError("API caller names and tokens must not be empty")
        if len(set(names)) != len(names) or len(set(tokens)) != len(tokens):
            raise ValueError("API caller names and tokens must each be unique")

    @classmethod
    def single(cls, token: str) -> Callers:
        """One caller, :data:`DEFAULT_CALLER`, with ``token``."""
        return cls(((DEFAULT_CALLER, token),))

    @classmethod
    def of(cls, api_token: str | Callers | None) -> Callers | None:
        """The callers an :attr:`Settings.api_token` value admits; ``None`` when auth is off."""
        if isinstance(api_token, Callers):
            return api_token
        return cls.single(api_token) if api_token else None

    @property
    def names(self) -> tuple[str, ...]:
        """The callers' names, in the order given."""
        return tuple(name for name, _ in self.entries)

    def caller(self, token: str) -> str | None:
        """The name ``token`` belongs to, or ``None``.

        Every token is compared, each in constant time, whether or not one matched already."""
        given = token.encode()
        found = None
        for name, expected in self.entries:
            if hmac.compare_digest(given, expected.encode()) and found is None:
                found = name
        return found

    def __repr__(self) -> str:
        """The names only (never the tokens)."""
        return f"Callers({', '.join(self.names)})"


@dataclass(frozen=True)
class Settings:
    """Everything the service is configured with. Field ``x_y`` is ``--x-y`` / ``PYHF_GPU_X_Y``."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port"})
    device: str = field(
        default="auto",
        metadata={
            "help": "auto (cuda when torch.cuda.is_available(), else cpu), cpu, cuda or cuda:N",
            "metavar": "{" + ",".join(DEVICE_CHOICES) + "}",
        },
    )
    dtype: str = field(
        default="float64", metadata={"help": "tensor dtype", "choices": DTYPE_CHOICES}
    )
    compile: str = field(
        default="auto",
        metadata={
            "help": "torch.compile warm models in the background (auto: on for cuda only)",
            "choices": ("auto", "on", "off"),
        },
    )
    dask_scheduler: str | None = field(
        default=None,
        metadata={
            "help": "run every engine batch on the Dask workers (pyhf-gpu-worker) of this "
            "scheduler, e.g. tcp://HOST:8786, instead of on this process's device; the API, the "
            "job store and the batching stay here",
            "metavar": "ADDRESS",
        },
    )
    data_dir: Path = field(
        default_factory=default_data_dir,
        metadata={"help": "uploaded workspaces and the job database (SQLite) live here"},
    )
    max_body_mb: float = field(
        default=64.0, metadata={"help": "largest request body, also after gzip decompression"}
    )
    max_batch_size: int = field(
        default=64, metadata={"help": "most hypotheses in one engine call (1 turns batching off)"}
    )
    max_batch_delay_ms: float = field(
        default=5.0, metadata={"help": "how long the scheduler waits to fill a batch, at most"}
    )
    batch_gap_ms: float = field(
        default=5.0,
        metadata={
            "help": "stop waiting for a batch to fill once no rows arrived for this long (a "
            "lone request does not wait out a long --max-batch-delay-ms)"
        },
    )
    prepare_wait_ms: float = field(
        default=200.0,
        metadata={
            "help": "how long a batch waits, at most, for requests on their way: being read "
            "and checked, or on its background and being translated (they would otherwise "
            "wait for its whole engine call and run in another; 0: never)"
        },
    )
    max_queue: int = field(
        default=256,
        metadata={"help": "pending interactive requests (and queued jobs) before 429"},
    )
    max_concurrent_jobs: int = field(
        default=2, metadata={"help": "asynchronous jobs worked on at the same time"}
    )
    max_jobs_per_caller: int = field(
        default=0,
        metadata={
            "help": "queued or running jobs one caller (API token) may have before 429; "
            "0: no cap beyond --max-queue"
        },
    )
    max_job_attempts: int = field(
        default=2,
        metadata={
            "help": "a job is failed, not resumed, once the server process has ended this many "
            "times while running it"
        },
    )
    model_cache_size: int = field(default=32, metadata={"help": "most models kept warm"})
    element_cache_size: int = field(
        default=4096,
        metadata={"help": "most translated patches (signal points) kept, over all backgrounds"},
    )
    local_workers: int = field(
        default=-1,
        metadata={
            "help": "processes forked at start-up that take shares of the CPU work: translating "
            "a request's many new patches and, on a CPU device, fitting an engine call's "
            "elements (-1: one per core beyond the first, at most 4; 0: none)"
        },
    )
    model_cache_memory_mb: float = field(
        default=4096.0, metadata={"help": "most device memory (MiB) held by warm models"}
    )
    max_parameters: int = field(
        default=5000, metadata={"help": "models with more parameters are refused (422)"}
    )
    max_bins: int = field(
        default=50_000, metadata={"help": "models with more bins are refused (422)"}
    )
    max_fit_memory_mb: float = field(
        default=4096.0,
        metadata={
            "help": "memory (MiB) the fits of one engine call may add to resident memory (70 percent "
            "for their rows and drawn toys, the rest left to the allocator): rows are split to "
            "fit, a model one row of which needs more is refused (422)"
        },
    )
    max_model_memory_mb: float = field(
        default=512.0,
        metadata={
            "help": "memory (MiB) one model's histosys arrays may take (each sample variant over "
            "every histosys parameter and bin of the model, estimated from its structure before "
            "any is built; about three copies are held while it is built): a workspace over it "
            "is refused (422), a request's patches are stacked into models under it"
        },
    )
    max_toys_per_request: int = field(
        default=10_000_000,
        metadata={
            "help": "toys a toy-based request may ask for in all (ntoys x hypotheses); more is "
            "refused (422)"
        },
    )
    job_chunk_s: float = field(
        default=2.0,
        metadata={
            "help": "seconds a chunk of a job may hold the device, sized from the measured time "
            "per row: interactive requests wait behind at most one such chunk"
        },
    )
    request_timeout_s: float = field(
        default=300.0, metadata={"help": "an interactive request answers 504 after this"}
    )
    result_ttl_hours: float = field(
        default=168.0, metadata={"help": "finished jobs and their results are kept this long"}
    )
    workspace_ttl_hours: float = field(
        default=168.0,
        metadata={
            "help": "uploaded workspaces no queued or running job needs expire this long "
            "after their last use"
        },
    )
    workspace_quota_mb: float = field(
        default=10240.0,
        metadata={
            "help": "disk (MiB) uploaded workspaces may take; the least recently used "
            "go first, and an upload that cannot fit answers 507"
        },
    )
    max_json_depth: int = field(default=64, metadata={"help": "deepest JSON nesting accepted"})
    graceful_timeout_s: float = field(
        default=30.0,
        metadata={"help": "on SIGTERM, how long in-flight requests may finish before exit"},
    )
    api_token: str | Callers | None = field(
        default=None,
        repr=False,
        metadata={"help": "when set, every route but /healthz and /readyz needs this Bearer token"},
    )
    api_token_file: Path | None = field(
        default=None,
        metadata={
            "help": "read the API token from this file (kept out of `ps`, unlike --api-token); "
            "or one 'NAME TOKEN' line per caller: each caller sees only its own jobs"
        },
    )
    header_timeout_s: float = field(
        default=10.0,
        metadata={"help": "a connection whose request headers are not complete by then is closed"},
    )
    body_timeout_s: float = field(
        default=30.0,
        metadata={"help": "a request whose body has not fully arrived by then answers 408"},
    )
    max_connections: int = field(
        default=256,
        metadata={"help": "open connections (and requests) before new requests get 503"},
    )
    log_level: str = field(default="info", metadata={"help": "log level", "choices": LOG_LEVELS})

    def __post_init__(self) -> None:
        """Check values that argparse/env parsing cannot (ranges, choices)."""
        problems = []
        if self.device not in ("auto", "cpu", "cuda") and not _is_cuda_index(self.device):
            problems.append(f"device {self.device!r} is not one of {', '.join(DEVICE_CHOICES)}")
        if self.dtype not in DTYPE_CHOICES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        if self.compile not in ("auto", "on", "off"):
            problems.append(f"compile {self.compile!r} is not one of auto, on, off")
        if self.log_level.lower() not in LOG_LEVELS:
            problems.append(f"log_level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        for name in (
            "max_body_mb",
            "max_batch_size",
            "max_queue",
            "max_concurrent_jobs",
            "max_job_attempts",
            "model_cache_size",
            "element_cache_size",
            "model_cache_memory_mb",
            "max_parameters",
            "max_bins",
            "max_fit_memory_mb",
            "max_model_memory_mb",
            "max_toys_per_request",
            "job_chunk_s",
            "request_timeout_s",
            "result_ttl_hours",
            "workspace_ttl_hours",
            "workspace_quota_mb",
            "max_json_depth",
            "graceful_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "max_connections",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("max_batch_delay_ms", "batch_gap_ms", "prepare_wait_ms"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative")
        if self.dask_scheduler is not None and not _is_address(self.dask_scheduler):
            problems.append(
                f"dask_scheduler {self.dask_scheduler!r} is not an address like tcp://HOST:8786"
            )
        if self.local_workers < -1:
            problems.append("local_workers must be -1 (one per spare core), 0 or more")
        if self.max_jobs_per_caller < 0:
            problems.append("max_jobs_per_caller must not be negative (0: no cap)")
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        object.__setattr__(self, "log_level", self.log_level.lower())

    @property
    def callers(self) -> Callers | None:
        """Who may call (token -> name), from :attr:`api_token`; ``None`` when auth is off."""
        return Callers.of(self.api_token)

    @property
    def max_body_bytes(self) -> int:
        """:attr:`max_body_mb` in bytes."""
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def max_model_bytes(self) -> int:
        """:attr:`max_model_memory_mb` in bytes (the translator's and the stacks' bound)."""
        return int(self.max_model_memory_mb * 1024 * 1024)

    @property
    def local_worker_count(self) -> int:
        """:attr:`local_workers`, ``-1`` resolved for this machine."""
        if self.local_workers == -1:
            return default_local_workers()
        return self.local_workers

    def compile_enabled(self, device: str) -> bool:
        """Whether to compile on ``device``: ``auto`` compiles on CUDA only (slow on CPU)."""
        return self.compile == "on" or (self.compile == "auto" and device.startswith("cuda"))

    def resolve_device(self, cuda_available: bool) -> str:
        """The concrete torch device: ``auto`` becomes ``cuda`` when available, else ``cpu``."""
        if self.device == "auto":
            return "cuda" if cuda_available else "cpu"
        return self.device


def _is_cuda_index(device: str) -> bool:
    """Whether ``device`` reads ``cuda:N``."""
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isdigit()


def _is_address(address: str) -> bool:
    """Whether ``address`` reads ``[PROTOCOL://]HOST:PORT`` (what Dask connects to)."""
    _, _, location = address.rpartition("://")
    host, _, port = location.rpartition(":")
    return bool(host) and port.isdigit()


def env_name(field_name: str) -> str:
    """The environment variable of a settings field: ``max_body_mb`` -> ``PYHF_GPU_MAX_BODY_MB``."""
    return ENV_PREFIX + field_name.upper()


def _field_type(f: dataclasses.Field[Any]) -> type:
    """The Python type a field's text value converts to."""
    annotation = str(f.type)
    for name, kind in (("int", int), ("float", float), ("Path", Path)):
        if annotation == name:
            return kind
    return str


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``pyhf-gpu-server`` argument parser; defaults come from ``PYHF_GPU_*`` variables."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="pyhf-gpu-server",
        description="HistFactory fitting service (pyhf-compatible answers, batched on a GPU).",
        epilog=f"Every option can also be set as an environment variable {ENV_PREFIX}<OPTION>, "
        "e.g. PYHF_GPU_DEVICE=cuda:1 or PYHF_GPU_API_TOKEN=secret.",
    )
    for f in dataclasses.fields(Settings):
        kind = _field_type(f)
        default = environ.get(env_name(f.name))
        help_text = f"{f.metadata.get('help', '')} (env {env_name(f.name)})"
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=kind,
            default=default or None,  # argparse converts a text default with `type`
            help=help_text,
            choices=f.metadata.get("choices"),
            metavar=f.metadata.get("metavar"),
        )
    return parser


def settings_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Settings from the command line, then ``PYHF_GPU_*`` variables, then the defaults."""
    parser = build_parser(environ)
    namespace = parser.parse_args(argv)
    given = {k: v for k, v in vars(namespace).items() if v is not None}
    try:
        return Settings(**given)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # pragma: no cover - parser.error exits
