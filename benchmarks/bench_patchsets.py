"""Patchsets end to end, side by side with NextStat, and the host cost of new patches.

Three parts, in one run, on this machine (prints markdown for BENCHMARKS.md):

1. **Commands**: a cold server (a new process and data dir per command, ready but with no
   warm model), then ``pyhf-gpu-client cls BkgOnly.json --patchset PS`` timed as a user runs
   it (the console script, its Python start-up included). The peer: a NextStat loop over the
   same patches in the peers' virtual environment (``jsonpatch`` apply, ``nextstat.from_pyhf``,
   ``nextstat.hypotest(1.0, model)`` per patch: CLs_obs only, where we also compute the
   expected band). Patchsets: the generated uniform and heterogeneous ones and the published
   HEPData points (217 and 218, one of which adds no signal and answers its own error); and
   larger likelihoods: the stau heterogeneous signals on published backgrounds combined
   (stau + 3l: 235 parameters; with sbottom A and B: 333).
2. **Concurrent clients**: 32 clients at once (processes, each its own ``pyhf_gpu_client.Client``,
   connected before the clock starts; they post together at a barrier: threads of one Python
   process would send their requests one GIL slice after another, over ~70 ms),
   each posting its own signal point on one uploaded background (``client.cls(workspace_id,
   patches=[patch])``, the id a :class:`WorkspaceId` from ``upload_workspace``; published
   sbottom points; 3l heterogeneous and uniform signals; the stau signals on the combined
   stau + 3l background of 235 parameters); wall time (the median of three bursts, each on
   a cold server: one burst lasts ~0.5 s), engine calls (from ``/metrics``, the most of the
   three), against the NextStat loop over the same 32 points. Default server settings but
   for the batch size and delay (512 rows, 50 ms).
3. **Host cost per phase** (in-process, one thread): parse, validate, translate, patch,
   tensors, compute, for a new patch on a warm background and a new ~330-parameter workspace
   (stau, 3l, sbottom A and B combined), and the first ``POST /cls`` of that bare workspace on
   a running server against NextStat's ``from_pyhf`` + ``hypotest``.

    .venv/bin/python benchmarks/bench_patchsets.py [--peer-python /tmp/bench-venv/bin/python]

The peers' environment: ``python3 -m venv /tmp/bench-venv && /tmp/bench-venv/bin/pip install
pyhf==0.7.6 nextstat``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pyhf_gpu_client import Client, WorkspaceId

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from peers import run_peer
from service_support import ServerProcess, metric_value
from workspaces import WORKSPACES_DIR as WORKSPACES  # tests/data/workspaces, or the env's
from workspaces import read_json, workspace_file

CLIENT = Path(sys.executable).with_name("pyhf-gpu-client")
# (workspace, patchset) in the shared folder; the combined likelihoods of 235 and 333
# parameters (`large_cases`) are added at run time
COMMANDS = [
    ("atlas-susy-2018-04-stau", "patchset.json"),
    ("atlas-susy-2018-04-stau", "patchset.heterogeneous.json"),
    ("atlas-susy-2019-09-3l-onshell", "patchset.json"),
    ("atlas-susy-2019-09-3l-onshell", "patchset.heterogeneous.json"),
    ("atlas-susy-2018-31-sbottom-A", "patchset.json"),
    ("atlas-susy-2018-31-sbottom-A", "patchset.hepdata.json.gz"),
    ("atlas-susy-2018-31-sbottom-B", "patchset.json"),
    ("atlas-susy-2018-31-sbottom-B", "patchset.hepdata.json.gz"),
]
ANALYSES = (
    "atlas-susy-2018-04-stau",
    "atlas-susy-2019-09-3l-onshell",
    "atlas-susy-2018-31-sbottom-A",
    "atlas-susy-2018-31-sbottom-B",
)
# (workspace, patchsets whose patches the clients post): distinct signal points only, 32
# clients; and the stau signals on the combined stau + 3l background (`concurrent_cases`)
CONCURRENT = [
    ("atlas-susy-2018-31-sbottom-A", ("patchset.hepdata.json.gz",)),
    ("atlas-susy-2019-09-3l-onshell", ("patchset.heterogeneous.json", "patchset.json")),
]
CLIENTS = 32
BURSTS = 3

PEER = r"""
import gzip, json, sys, time, copy
import jsonpatch, nextstat
cfg = json.loads(sys.stdin.read())
out = []
for case in cfg:
    raw = open(case["background"], "rb").read()
    background = json.loads(gzip.decompress(raw) if case["background"].endswith(".gz") else raw)
    start = time.perf_counter()
    cls = {}
    for name, ops in case["patches"]:
        spec = jsonpatch.apply_patch(background, ops)
        try:
            cls[name] = nextstat.hypotest(1.0, nextstat.from_pyhf(json.dumps(spec)))
        except Exception as exc:
            cls[name] = type(exc).__name__
    out.append({"seconds": time.perf_counter() - start, "cls": cls})
print(json.dumps(out))
"""


def read(path: Path) -> Any:
    return read_json(path)  # ``x.json`` may be ``x.json.gz`` on disk


def patches_of(name: str, file: str) -> list[tuple[str, list]]:
    return [(p["metadata"]["name"], p["patch"]) for p in read(WORKSPACES / name / file)["patches"]]


def pyhf_reference(background: Path, patchset: Path) -> dict[str, float]:
    """pyhf's CLs_obs at mu=1 for the points of ``patchset`` that its folder has references
    for (the shared folders only)."""
    folder, file = background.parent, patchset.name
    if not (folder / "reference.json").exists():
        return {}
    if file == "patchset.hepdata.json.gz":
        results = read(folder / "reference.hepdata.json")["results"]
        return {k: v["CLs_obs"] for k, v in results.items()}
    if file == "patchset.json":
        results = read(folder / "reference.json")["reference"]["results"]
        return {r["patch"]: r["CLs_obs"] for r in results}
    return {}


def nextstat_loops(peer_python: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = run_peer(peer_python, PEER, cases, threads=1, timeout=3600, check=True)
    return json.loads(proc.stdout)


def cold_server(data_dir: Path) -> ServerProcess:
    return ServerProcess(
        data_dir, ["--max-batch-size", "512", "--max-batch-delay-ms", "50"]
    ).start()


def _peak_rss(pid: int, stop: threading.Event, found: list[int]) -> None:
    """Sample a process's resident memory every 0.1 s into ``found`` until ``stop``."""
    while not stop.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    found.append(int(line.split()[1]) * 1024)
        except OSError:
            return
        stop.wait(0.1)


def client_command(args: list[str], client: Path = CLIENT) -> dict[str, Any]:
    """One cold server, one client command ``client cls *args`` (the console script): seconds,
    results, the client's stderr, and the server's peak resident memory (bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        server = cold_server(Path(tmp))
        stop, found = threading.Event(), []
        watcher = threading.Thread(target=_peak_rss, args=(server.process.pid, stop, found))
        watcher.start()
        try:
            env = {**os.environ, "PYHF_GPU_SERVER": server.url}
            start = time.perf_counter()
            proc = subprocess.run(
                [str(client), "cls", *map(str, args)],
                capture_output=True,
                text=True,
                env=env,
                timeout=1800,
                check=True,
            )
            seconds = time.perf_counter() - start
        finally:
            stop.set()
            watcher.join()
            server.stop()
    return {
        "seconds": seconds,
        "results": json.loads(proc.stdout),
        "stderr": proc.stderr,
        "rss": max(found, default=0),
    }


def command(background: Path, patchset: Path, client: Path = CLIENT) -> dict[str, Any]:
    """:func:`client_command` of a background and a patchset."""
    return client_command(
        [workspace_file(background), "--patchset", workspace_file(patchset)], client
    )


def one_client(url: str, workspace_id: str, ops: list, ready: Any, answers: Any) -> None:
    """A client process: connected, it waits for the others, posts its signal point on the
    uploaded background, and answers when it posted, when it had its answer (the clock is
    the machine's) and whether its fits converged."""
    with Client(url, timeout=600) as own:
        own.health()  # connected (httpx opens its connection on the first request)
        ready.wait(timeout=600)
        start = time.perf_counter()
        meta = own.cls(WorkspaceId(workspace_id), patches=[ops]).meta
        answers.put((start, time.perf_counter(), bool(meta["converged"])))


def concurrent_clients(background: Path, chosen: list[tuple[str, list]]) -> dict[str, Any]:
    """A client process per signal point, at once, on an uploaded background: seconds, engine
    calls, fits converged."""
    with tempfile.TemporaryDirectory() as tmp:
        server = cold_server(Path(tmp))
        try:
            with Client(server.url, timeout=600) as client:
                workspace_id = client.upload_workspace(workspace_file(background))
                before = metric_value(client.metrics(), "pyhf_gpu_batch_size_count")

                forked = multiprocessing.get_context("fork")
                ready = forked.Barrier(len(chosen) + 1)
                answers: multiprocessing.Queue = forked.Queue()
                processes = [
                    forked.Process(
                        target=one_client, args=(server.url, workspace_id, ops, ready, answers)
                    )
                    for _, ops in chosen
                ]
                for process in processes:
                    process.start()
                ready.wait(timeout=600)  # every client is up: they post at once
                outcomes = [answers.get(timeout=600) for _ in processes]
                seconds = max(o[1] for o in outcomes) - min(o[0] for o in outcomes)
                for process in processes:
                    process.join()
                calls = metric_value(client.metrics(), "pyhf_gpu_batch_size_count")
        finally:
            server.stop()
    return {
        "seconds": seconds,
        "calls": calls - before,
        "converged": sum(o[2] for o in outcomes),
    }


def concurrent_cases(folder: Path) -> list[tuple[str, Path, list[tuple[str, list]]]]:
    """(label, background, the clients' signal points): the published ones of ``CONCURRENT``
    (points that add a signal), and stau signals (heterogeneous, then uniform) on the stau + 3l
    background (235 pars), written to ``folder``; ``CLIENTS`` points each."""
    cases = []
    for name, files in CONCURRENT:
        signals = [p for file in files for p in patches_of(name, file) if len(p[1]) > 1]
        label = f"{name} ({' + '.join(files)})"
        cases.append((label, WORKSPACES / name / "BkgOnly.json", signals[:CLIENTS]))
    spec, text = combined_workspace(ANALYSES[:2])
    background = folder / "stau+3l.BkgOnly.json"
    background.write_bytes(text)
    signals = [
        p
        for file in ("patchset.heterogeneous.json", "patchset.json")
        for p in stau_signals_on(spec, file)
    ]
    cases.append(
        ("stau+3l, 235 pars (stau heterogeneous + uniform signals)", background, signals[:CLIENTS])
    )
    return cases


def host_phases() -> str:
    """The in-process cost of each phase, for a new patch and a new large workspace."""
    import orjson
    import torch

    from pyhf_gpu_server import inference
    from pyhf_gpu_server.cli import GC_THRESHOLDS
    from pyhf_gpu_server.engine import HistFactoryModel, schema
    from pyhf_gpu_server.engine.translate import WorkspaceTranslator

    torch.set_num_threads(1)
    gc.set_threshold(*GC_THRESHOLDS)  # as the server runs (default ones: parsing 10x slower)

    def clock(fn, repeats: int = 5) -> tuple[float, Any]:
        times, value = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            value = fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times), value

    rows = []
    for name, file in [
        ("atlas-susy-2018-04-stau", "patchset.heterogeneous.json"),
        ("atlas-susy-2019-09-3l-onshell", "patchset.heterogeneous.json"),
        ("atlas-susy-2018-31-sbottom-A", "patchset.hepdata.json.gz"),
    ]:
        background = read(WORKSPACES / name / "BkgOnly.json")
        translator = WorkspaceTranslator(background)
        patches = patches_of(name, file)[:8]
        body = json.dumps(patches[0][1]).encode()
        parse, _ = clock(lambda body=body: orjson.loads(body))
        validate, _ = clock(lambda p=patches: schema.validate(p[0][1], "jsonpatch.json"))
        times = [clock(lambda p=p, t=translator: t.element(p[1], p[0]), 1)[0] for p in patches]
        element = translator.element(patches[0][1], patches[0][0])
        tensors, model = clock(lambda e=element: HistFactoryModel([e]))
        one = torch.ones(1, dtype=torch.float64)
        compute, _ = clock(lambda m=model, one=one: inference.hypotest(m, one), 3)
        rows.append(
            f"| new patch on warm {name} ({model.n_pars} pars) | {parse * 1e3:.2f} | "
            f"{validate * 1e3:.2f} | {statistics.median(times) * 1e3:.2f} (patch + translate) | "
            f"{tensors * 1e3:.1f} | {compute * 1e3:.0f} |"
        )
    combined, text = combined_workspace()
    translator = WorkspaceTranslator(combined)
    patches = stau_signals_on(combined)[:8]
    times = [clock(lambda p=p, t=translator: t.element(p[1], p[0]), 1)[0] for p in patches]
    first = translator.element(patches[0][1], patches[0][0])
    size = sum(parameter_set.n_parameters for parameter_set in first.parameters)
    rows.append(
        f"| new patch on warm stau+3l+sbottom A+B ({size} pars; a stau heterogeneous signal) | "
        f"- | - | {statistics.median(times) * 1e3:.2f} (patch + translate) | - | - |"
    )
    parse, _ = clock(lambda: orjson.loads(text), 3)
    validate, _ = clock(lambda: schema.validate(combined, "workspace.json"), 3)
    translate, translator = clock(lambda: WorkspaceTranslator(combined, validate=False), 3)
    element_s, element = clock(lambda: translator.element([], "combined"), 3)
    tensors, model = clock(lambda: HistFactoryModel([element]), 3)
    compute, _ = clock(lambda: inference.hypotest(model, torch.ones(1, dtype=torch.float64)), 3)
    rows.append(
        f"| new workspace: stau+3l+sbottom A+B ({model.n_pars} pars, {len(text) // 1024} kB) | "
        f"{parse * 1e3:.1f} | {validate * 1e3:.1f} | {(translate + element_s) * 1e3:.1f} | "
        f"{tensors * 1e3:.1f} | {compute * 1e3:.0f} |"
    )
    header = (
        "| case | parse ms | validate ms | translate ms | tensors ms | compute ms (1 hypotest) |\n"
        "|---|---|---|---|---|---|\n"
    )
    return header + "\n".join(rows)


@functools.cache
def combined_workspace(analyses: tuple[str, ...] = ANALYSES) -> tuple[dict[str, Any], bytes]:
    """Published background-only workspaces combined into one likelihood: stau + 3l (235
    pars), or with sbottom A (with one signal each, as stau and 3l then) and sbottom B
    renamed apart (333 pars). Built once per run (every part reads it, none changes it)."""
    import pyhf

    with_signal = "atlas-susy-2018-31-sbottom-A" in analyses
    parts = []
    for name in analyses:
        ws = pyhf.Workspace(read(WORKSPACES / name / "BkgOnly.json"))
        if with_signal:
            ws = pyhf.PatchSet(read(WORKSPACES / name / "patchset.json")).apply(ws, "sig_s1_x1")
        parts.append(ws)
    if "atlas-susy-2018-31-sbottom-B" in analyses:
        last = parts[-1]
        names = last.model().config.par_order
        parts[-1] = last.rename(
            channels={c: f"B_{c}" for c in last.channels},
            modifiers={m: m if m in ("mu_SIG", "lumi") else f"B_{m}" for m in names},
        )
    combined = parts[0]
    for part in parts[1:]:
        combined = pyhf.Workspace.combine(combined, part, join="left outer")
    spec = json.loads(json.dumps(combined))
    return spec, json.dumps(spec).encode()


def stau_signals_on(
    combined: dict[str, Any], file: str = "patchset.heterogeneous.json"
) -> list[tuple[str, list]]:
    """The stau signal points of ``file`` as patches of the combined workspace: their
    samples appended to the stau channels (renamed apart from any signal already there)."""
    stau = read(WORKSPACES / "atlas-susy-2018-04-stau" / "BkgOnly.json")
    index = {channel["name"]: i for i, channel in enumerate(combined["channels"])}
    out = []
    for name, operations in patches_of("atlas-susy-2018-04-stau", file):
        moved = []
        for op in operations:
            channel = stau["channels"][int(op["path"].split("/")[2])]["name"]
            value = {**op["value"], "name": "signal_point"}
            moved.append({**op, "path": f"/channels/{index[channel]}/samples/-", "value": value})
        out.append((name, moved))
    return out


def large_cases(folder: Path) -> list[tuple[str, Path, Path]]:
    """The 24 stau heterogeneous signals on the two combined likelihoods (235 and 333 pars),
    written to ``folder`` as a background and a patchset (pyhf's format, its digest)."""
    import pyhf

    template = read(WORKSPACES / "atlas-susy-2018-04-stau" / "patchset.heterogeneous.json")
    cases = []
    for label, analyses in (("stau+3l", ANALYSES[:2]), ("stau+3l+sbottom A+B", ANALYSES)):
        spec, text = combined_workspace(analyses)
        background = folder / f"{label}.BkgOnly.json"
        background.write_bytes(text)
        metadata = {**template["metadata"], "digests": {"sha256": pyhf.utils.digest(spec)}}
        patchset = {
            "metadata": metadata,
            "version": template["version"],
            "patches": [
                {"metadata": original["metadata"], "patch": operations}
                for original, (_, operations) in zip(
                    template["patches"], stau_signals_on(spec), strict=True
                )
            ],
        }
        path = folder / f"{label}.patchset.json"
        path.write_text(json.dumps(patchset))
        cases.append((label, background, path))
    return cases


def first_request(peer_python: str) -> str:
    """First POST /cls of a new bare ~330-parameter workspace vs NextStat from_pyhf+hypotest."""
    _, text = combined_workspace()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "combined.json"
        path.write_bytes(text)
        (Path(tmp) / "data").mkdir()
        server = cold_server(Path(tmp) / "data")
        try:
            with httpx.Client(base_url=server.url, timeout=600) as client:
                start = time.perf_counter()
                response = client.post(
                    "/cls", content=text, headers={"content-type": "application/json"}
                )
                seconds = time.perf_counter() - start
                response.raise_for_status()
                ours = response.json()
        finally:
            server.stop()
        peer = nextstat_loops(peer_python, [{"background": str(path), "patches": [["c", []]]}])[0]
    return (
        f"| first POST /cls of a new bare workspace (ours: HTTP, parse, validate, translate, "
        f"build, CLs + band) | {seconds:.2f} s | {peer['seconds']:.2f} s | "
        f"{peer['seconds'] / seconds:.1f}x | CLs_obs {ours['CLs_obs']:.5f} vs "
        f"{peer['cls']['c'] if isinstance(peer['cls']['c'], str) else round(peer['cls']['c'], 5)} |"
    )


def print_commands(
    cases: list[tuple[str, Path, Path]], clients: list[Path], peer_python: str
) -> None:
    """The commands table: each case a cold server and a client command, against a NextStat
    loop over the same patches."""
    runs = {c: [command(bg, patchset, c) for _, bg, patchset in cases] for c in clients}
    peers = nextstat_loops(
        peer_python,
        [
            {
                "background": str(workspace_file(background)),
                "patches": [(p["metadata"]["name"], p["patch"]) for p in read(patchset)["patches"]],
            }
            for _, background, patchset in cases
        ],
    )
    for client in clients:
        print(f"\nclient: {client}")
        print(
            "| workspace | pars | patchset | patches | ours: client command, cold server | "
            "NextStat loop | ratio | ours vs pyhf's reference points: max abs. CLs_obs diff "
            "(points) | ours vs NextStat: max abs. CLs_obs diff | points NextStat failed or "
            "answered 0 | points we did not test |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for (label, background, patchset), peer, mine in zip(
            cases, peers, runs[client], strict=True
        ):
            reference = pyhf_reference(background, patchset)
            diffs = [abs(mine["results"][k]["CLs_obs"] - v) for k, v in reference.items()]
            worst = f"{max(diffs):.1e} ({len(diffs)})" if diffs else "-"
            failed = sum(1 for v in peer["cls"].values() if isinstance(v, str) or v == 0.0)
            versus = max(
                abs(mine["results"][k]["CLs_obs"] - v)
                for k, v in peer["cls"].items()
                if not isinstance(v, str) and v != 0.0 and "CLs_obs" in mine["results"].get(k, {})
            )
            print(
                f"| {label} | {parameters(background, patchset)} | {patchset.name} | {len(peer['cls'])} | "
                f"{mine['seconds']:.2f} s | {peer['seconds']:.2f} s | "
                f"{peer['seconds'] / mine['seconds']:.1f}x | {worst} | {versus:.1e} | {failed} | "
                f"{mine['stderr'].count('was not tested')} |"
            )


def parameters(background: Path, patchset: Path) -> int:
    """The parameters of the model of the patchset's first signal point (our translator's
    count, equal to pyhf's: tested)."""
    from pyhf_gpu_server.engine.translate import WorkspaceTranslator

    first = read(patchset)["patches"][0]
    element = WorkspaceTranslator(read(background)).element(first["patch"], "first")
    return sum(parameter_set.n_parameters for parameter_set in element.parameters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", default="/tmp/bench-venv/bin/python")
    parser.add_argument("--parts", nargs="*", default=["commands", "concurrent", "phases"])
    parser.add_argument(
        "--client",
        action="append",
        type=Path,
        help="a pyhf-gpu-client console script to time (repeatable; default: this venv's). "
        "A thin client as users install it: python3 -m venv V && V/bin/pip install .",
    )
    args = parser.parse_args()
    clients = args.client or [CLIENT]
    print(f"load average before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if "commands" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            cases = [
                (name, WORKSPACES / name / "BkgOnly.json", WORKSPACES / name / file)
                for name, file in COMMANDS
            ] + large_cases(Path(tmp))
            print_commands(cases, clients, args.peer_python)
    if "concurrent" in args.parts:
        print(
            "\n| concurrent clients, one distinct signal point each | ours (median of "
            f"{BURSTS} bursts, range) | NextStat loop | "
            "ratio | engine calls (most) | fits converged (fewest) |\n|---|---|---|---|---|---|"
        )
        with tempfile.TemporaryDirectory() as tmp:
            for label, background, signals in concurrent_cases(Path(tmp)):
                # a burst lasts ~0.5 s: the median of BURSTS, each on a cold server
                bursts = sorted(
                    (concurrent_clients(background, signals) for _ in range(BURSTS)),
                    key=lambda burst: burst["seconds"],
                )
                mine = bursts[len(bursts) // 2]
                spread = f"{bursts[0]['seconds']:.2f}-{bursts[-1]['seconds']:.2f}"
                peer = nextstat_loops(
                    args.peer_python,
                    [{"background": str(workspace_file(background)), "patches": signals}],
                )[0]
                print(
                    f"| {len(signals)} on {label} | {mine['seconds']:.2f} s ({spread}) | "
                    f"{peer['seconds']:.2f} s | {peer['seconds'] / mine['seconds']:.1f}x | "
                    f"{max(b['calls'] for b in bursts):.0f} | "
                    f"{min(b['converged'] for b in bursts)}/{len(signals)} |"
                )
    if "phases" in args.parts:
        print()
        print(host_phases())
        print()
        print("| case | ours | NextStat | ratio | result |\n|---|---|---|---|---|")
        print(first_request(args.peer_python))


if __name__ == "__main__":
    main()
