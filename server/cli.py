"""``pyhf-gpu-server``: run the service with uvicorn (options from flags or PYHF_GPU_* variables)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import uvicorn

from pyhf_gpu_server.service.app import create_app
from pyhf_gpu_server.service.logs import configure_logging
from pyhf_gpu_server.service.settings import settings_from_args
from pyhf_gpu_server.service.state import resolve_device


def main(argv: Sequence[str] | None = None) -> int:
    """Parse settings, check the device, serve until SIGTERM/SIGINT (then shut down gracefully)."""
    settings = settings_from_args(argv)
    configure_logging(settings.log_level)
    try:
        resolve_device(settings)
    except ValueError as exc:
        print(f"pyhf-gpu-server: error: {exc}", file=sys.stderr)
        return 2
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=max(1, round(settings.graceful_timeout_s)),
        proxy_headers=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
