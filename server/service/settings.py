"""Service settings: one immutable object, read from the command line and ``PYHF_GPU_*`` variables.

Nothing here is process-wide: :func:`pyhf_gpu_server.service.app.create_app` receives a
:class:`Settings` and everything (device, dtype, limits) flows from it to the parts that need it.
``Settings(...)`` holds what it is given (and the defaults) only; :func:`settings_from_args` adds
the environment and the command line. Each field's description is its ``--help`` text and its
row of the table in docs/SERVICE.md (``python -m pyhf_gpu_server.service.settings`` prints it).
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BeforeValidator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

ENV_PREFIX = "PYHF_GPU_"
DEFAULT_CALLER = "default"
"""The caller's name when the server has one token (``--api-token``, or a one-token file)."""
LIMITS = (
    *("max_body_mb", "max_batch_size", "max_batch_delay_ms", "batch_gap_ms", "prepare_wait_ms"),
    *("max_queue", "request_timeout_s", "result_ttl_hours", "max_parameters", "max_bins"),
    *("max_fit_memory_mb", "max_model_memory_mb", "max_toys_per_request", "job_chunk_s"),
    *("max_jobs_per_caller", "workspace_ttl_hours", "workspace_quota_mb"),
)
"""The settings ``GET /info`` shows as ``limits`` (:meth:`Settings.limits`)."""


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


def _setting(default: Any, help: str, **kwargs: Any) -> Any:
    """A field: ``help`` is its ``--help`` text and docs row; ``metavar`` and ``shown`` (the
    default as the docs show it) go to ``json_schema_extra``."""
    extra: dict[str, Any] = {k: kwargs.pop(k) for k in ("metavar", "shown") if k in kwargs}
    if callable(default):
        kwargs["default_factory"] = default
    else:
        kwargs["default"] = default
    return Field(description=help, json_schema_extra=extra or None, **kwargs)


class Settings(BaseSettings):
    """Everything the service is configured with. Field ``x_y`` is ``--x-y`` / ``PYHF_GPU_X_Y``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,  # PYHF_GPU_X= (as .env.example leaves them) means the default
        frozen=True,
        arbitrary_types_allowed=True,  # api_token: Callers, once read from --api-token-file
    )

    host: str = _setting("127.0.0.1", "address to listen on")
    port: int = _setting(8000, "TCP port")
    device: str = _setting(
        "auto",
        "`auto` (cuda when `torch.cuda.is_available()`, else cpu), `cpu`, `cuda` or `cuda:N`",
        metavar="{auto,cpu,cuda,cuda:N}",
    )
    dtype: Literal["float64", "float32"] = _setting(
        "float64", "tensor dtype: `float64` or `float32`"
    )
    compile: Literal["auto", "on", "off"] = _setting(
        "auto",
        "`torch.compile` each new warm model in a background thread (the first requests run "
        "eagerly meanwhile); `auto` = on for CUDA only (compiling takes ~30 s on a CPU)",
    )
    dask_scheduler: str | None = _setting(
        None,
        "cluster mode: run every engine batch on the Dask workers (`pyhf-gpu-worker`) of this "
        "scheduler, e.g. `tcp://HOST:8786`, instead of on this process's device; the API, the "
        "job store and the batching stay here; `--device` and `--compile` then do not apply",
        metavar="ADDRESS",
    )
    data_dir: Path = _setting(
        default_data_dir,
        "uploaded workspaces (`workspaces/<id>.json`) and the job database (`jobs.sqlite3`, "
        "WAL) live here",
        shown="`~/.local/share/pyhf-gpu`",
    )
    max_body_mb: PositiveFloat = _setting(
        64.0,
        "largest request body, checked on Content-Length, on the streamed bytes and after "
        "gunzip (413)",
    )
    max_batch_size: PositiveInt = _setting(
        64, "most hypotheses in one engine call; 1 turns batching off"
    )
    max_batch_delay_ms: NonNegativeFloat = _setting(
        5.0, "how long the scheduler waits to fill a batch, at most"
    )
    batch_gap_ms: NonNegativeFloat = _setting(
        5.0,
        "stop waiting for a batch to fill once no rows arrived for this long (a lone request "
        "does not wait out a long `--max-batch-delay-ms`)",
    )
    prepare_wait_ms: NonNegativeFloat = _setting(
        200.0,
        "how long a batch waits, at most, for requests on their way: being read and checked, "
        "or on its background and being translated (their rows would otherwise wait for its "
        "whole engine call and run in another); 0 = never",
    )
    max_queue: PositiveInt = _setting(
        256, "interactive requests waiting for the device (and queued jobs) before 429"
    )
    max_concurrent_jobs: PositiveInt = _setting(2, "asynchronous jobs worked on at the same time")
    max_jobs_per_caller: NonNegativeInt = _setting(
        0,
        "queued or running jobs one caller (API token) may have; one more answers 429 with "
        "`Retry-After`; 0 = no cap beyond `--max-queue`; not applied with auth off (no "
        "callers), and with one token it caps that token's jobs",
    )
    max_job_attempts: PositiveInt = _setting(
        2,
        "a job is failed, not resumed, once the server process has ended this many times "
        "while running it",
    )
    model_cache_size: PositiveInt = _setting(32, "most models kept warm")
    element_cache_size: PositiveInt = _setting(
        4096, "translated patches (signal points) kept, over all backgrounds (LRU)"
    )
    local_workers: int = _setting(
        -1,
        "processes forked at start-up (before any thread) that take shares of the CPU work: "
        "they translate shares of a request with at least 32 new patches while the server "
        "translates its own share, and on a CPU device (not in cluster mode) each fits a share "
        "of an engine call's elements, or of a lone element's rows (one intra-op thread, its "
        "own warm model of those elements) while the device thread fits its own (toy slices "
        "too: their draws follow the row); not for a batch of one row, nor while a worker is "
        "busy. With engine workers the device thread fits on one intra-op thread. `-1` = one "
        "per core beyond the first, at most 4; `0` = none. "
        "A worker that dies or does not answer in time (translation: 10 s + 50 ms a patch; a "
        "fit share: 30 s + 4x the device thread's own share) is dropped and its share done by "
        "the server; a share it fitted names it in `meta.worker` (`local-worker-<pid>`); "
        "`/info` shows `local_workers` (in use, requests and engine calls shared)",
        ge=-1,
    )
    model_cache_memory_mb: PositiveFloat = _setting(
        4096.0, "most device memory (MiB) held by warm models"
    )
    max_parameters: PositiveInt = _setting(
        5000,
        "models with more parameters are refused with a 422 naming the limit, before any work "
        "(per patch in a patchset); a request's patches are stacked into models whose union "
        "stays within it and within twice the largest patch's parameters + 16 (patches that "
        "each bring their own modifiers are answered from several smaller models: cheaper "
        "than one union)",
    )
    max_bins: PositiveInt = _setting(
        50_000, "models with more bins are refused with a 422 naming the limit"
    )
    max_fit_memory_mb: PositiveFloat = _setting(
        4096.0,
        "memory (MiB) the fits of one engine call may add to resident memory, 70% of it "
        "admitted to their rows and drawn toys, the rest left to the allocator (per row ~8 (10 "
        "P^2 + 2 N P) bytes with the dense solver, less with the low-rank one, ~8 (3 N K + 4 "
        "K^2) with the block one, K the parameters that are not per-bin: "
        "`service/admission.py`): rows are split into minimiser calls that fit; the low-rank "
        "solver is used where a dense row would not fit but a low-rank one does; a model one "
        "row of which needs more is refused (422)",
    )
    max_model_memory_mb: PositiveFloat = _setting(
        512.0,
        "memory (MiB) one model's histosys arrays may take (each sample variant over every "
        "histosys parameter and bin of the model, `8 K J N` bytes; estimated from the "
        "structure before any is built, about three copies are held while a model is built): "
        "a workspace over it is refused with a 422 naming the figure before it is translated, "
        "and a request's patches are stacked into models under it",
    )
    max_toys_per_request: PositiveInt = _setting(
        10_000_000,
        "toys a toy-based request or job may ask for in all (ntoys x hypotheses); more is "
        "refused (422) before any work",
    )
    job_chunk_s: PositiveFloat = _setting(
        2.0,
        "seconds a chunk of a job may hold the device: chunks are sized from the measured "
        "seconds per row of their batch key (a first chunk from a conservative prior), at "
        "least one row, so interactive requests wait behind at most one such chunk",
    )
    request_timeout_s: PositiveFloat = _setting(
        300.0, "an interactive request answers 504 after this"
    )
    result_ttl_hours: PositiveFloat = _setting(
        168.0, "finished jobs and their results are kept this long"
    )
    workspace_ttl_hours: PositiveFloat = _setting(
        168.0,
        "uploaded workspaces no queued or running job needs expire this long after their last use",
    )
    workspace_quota_mb: PositiveFloat = _setting(
        10240.0,
        "disk (MiB) uploaded workspaces may take; the least recently used go first, and an "
        "upload that cannot fit answers 507; with named callers the quota is each caller's, "
        "and eviction only among its own",
    )
    max_json_depth: PositiveInt = _setting(
        64, "deeper JSON nesting is refused before any model is built"
    )
    graceful_timeout_s: PositiveFloat = _setting(
        30.0, "on SIGTERM, how long in-flight requests may finish before exit"
    )
    api_token: str | Callers | None = _setting(
        None,
        "turns on Bearer auth with this token (the probes, /openapi.json, /docs and the web page "
        "stay open); on the command line it shows in `ps`: prefer the variable or the file",
        repr=False,
    )
    api_token_file: Path | None = _setting(
        None,
        "turns on Bearer auth with the token read from this file (preferred), or with one "
        "token per caller: `NAME TOKEN` lines (each caller sees only its own jobs)",
    )
    header_timeout_s: PositiveFloat = _setting(
        10.0,
        "a connection whose request headers are not complete this long after it opened (or "
        "after its previous answer) is closed",
    )
    body_timeout_s: PositiveFloat = _setting(
        30.0,
        "a request whose body has not fully arrived this long after its headers answers 408 "
        "and its connection is closed (raise it for large uploads over slow links)",
    )
    max_connections: PositiveInt = _setting(
        256,
        "open connections (and requests in progress) beyond which new requests answer 503 "
        "(uvicorn's `limit_concurrency`)",
    )
    log_level: Annotated[
        Literal["debug", "info", "warning", "error"], BeforeValidator(str.lower)
    ] = _setting(
        "info",
        "`debug`, `info`, `warning` or `error`; logs are JSON lines on stderr (pyhf's own INFO "
        "lines only at `debug`); one `request` line per request with `request_id`, route, "
        "status and `duration_ms`",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """What it is given only: the environment is read by :func:`settings_from_args`."""
        return (init_settings,)

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        prefix, _, index = device.partition(":")
        if device in ("auto", "cpu", "cuda") or (prefix == "cuda" and index.isdigit()):
            return device
        raise ValueError(f"{device!r} is not one of auto, cpu, cuda, cuda:N")

    @field_validator("dask_scheduler")
    @classmethod
    def _address(cls, address: str | None) -> str | None:
        """``[PROTOCOL://]HOST:PORT`` (what Dask connects to)."""
        host, _, port = (address or "h:1").rpartition("://")[2].rpartition(":")
        if host and port.isdigit():
            return address
        raise ValueError(f"{address!r} is not an address like tcp://HOST:8786")

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

    def limits(self) -> dict[str, Any]:
        """The settings ``GET /info`` shows as ``limits`` (:data:`LIMITS`)."""
        return {name: getattr(self, name) for name in LIMITS}

    def compile_enabled(self, device: str) -> bool:
        """Whether to compile on ``device``: ``auto`` compiles on CUDA only (slow on CPU)."""
        return self.compile == "on" or (self.compile == "auto" and device.startswith("cuda"))

    def resolve_device(self, cuda_available: bool) -> str:
        """The concrete torch device: ``auto`` becomes ``cuda`` when available, else ``cpu``."""
        if self.device == "auto":
            return "cuda" if cuda_available else "cpu"
        return self.device


def env_name(field_name: str) -> str:
    """The environment variable of a settings field: ``max_body_mb`` -> ``PYHF_GPU_MAX_BODY_MB``."""
    return ENV_PREFIX + field_name.upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _extra(name: str, key: str) -> Any:
    extra = Settings.model_fields[name].json_schema_extra
    return extra.get(key) if isinstance(extra, dict) else None


def build_parser() -> argparse.ArgumentParser:
    """The ``pyhf-gpu-server`` argument parser: a flag per field, its description the help."""
    parser = argparse.ArgumentParser(
        prog="pyhf-gpu-server",
        description="HistFactory fitting service (pyhf-compatible answers, batched on a GPU).",
        epilog=f"Every option can also be set as an environment variable {ENV_PREFIX}<OPTION>, "
        "e.g. PYHF_GPU_DEVICE=cuda:1 or PYHF_GPU_API_TOKEN=secret; flags win over variables.",
    )
    for name, info in Settings.model_fields.items():
        choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else ()
        parser.add_argument(
            _flag(name),
            dest=name,
            help=f"{info.description} (default {_default(name)}; env {env_name(name)})".replace(
                "`", ""
            ).replace("%", "%%"),
            metavar=_extra(name, "metavar") or ("{" + ",".join(choices) + "}" if choices else None),
        )  # the text is converted and checked by Settings
    return parser


def settings_from_args(argv: Sequence[str] | None = None) -> Settings:
    """Settings from the command line, then ``PYHF_GPU_*`` variables, then the defaults.

    A value that does not convert or is out of range exits (2) with a message naming its flag.
    """
    parser = build_parser()
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    try:
        return Settings(**{**EnvSettingsSource(Settings)(), **given})
    except ValidationError as exc:
        parser.error(
            "; ".join(
                f"{_flag(str(e['loc'][0]))} ({env_name(str(e['loc'][0]))}) {e['input']!r}: {e['msg']}"
                for e in exc.errors()
            )
        )


def _default(name: str) -> str:
    """A field's default as ``--help`` and the docs show it."""
    default = Settings.model_fields[name].default
    if _extra(name, "shown"):
        return str(_extra(name, "shown"))
    return "none" if default is None else f"{default:g}" if isinstance(default, float) else default


def markdown_table() -> str:
    """The settings table of docs/SERVICE.md: flag, default and description of every field."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for name, info in Settings.model_fields.items():
        rows.append(f"| `{_flag(name)}` | {_default(name)} | {info.description} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
