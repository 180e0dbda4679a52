"""Throughput and latency of the Ray Serve app (pipeline/serve/app.py) under N concurrent clients.

Starts its own local Ray and the app on 127.0.0.1, then N client threads each send
``POST /translate`` requests of ``--sentences-per-request`` newstest2014 sentences back to back
for ``--duration-s`` seconds (bounded: every request has a timeout; no request is started after
the deadline). Prints requests/s, sentences/s, p50 / p99 latency, and sent vs answered: a lost
request (no answer, or not 200) is counted and reported, never hidden.

    .venv/bin/python benchmarks/serve_bench.py [--clients 8] [--duration-s 30] [--backend torch|ctranslate2]
                                               [--max-batch-size 16] [--replicas 1] [--work-dir work/local]

Weights: ``--work-dir``'s latest averaged model (and export), else the tiny model of
tests/support/tiny_model.py trained here (~30 s) and exported here.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

log = logging.getLogger("serve_bench")


def app_args(args: argparse.Namespace, root: Path) -> dict:
    common = {"backend": args.backend, "max_batch_size": args.max_batch_size, "num_replicas": args.replicas,
              "beam_size": args.beam, "max_sentences_per_request": max(64, args.sentences_per_request)}
    if args.work_dir:
        return {"work_dir": args.work_dir, **common}
    from pipeline.serve.export import export_all
    from tests.support.tiny_model import train_tiny_model

    tiny = train_tiny_model(Path(args.data), root / "tiny")
    out = {"model_dir": tiny["model_dir"], "spm": tiny["spm"], **common}
    if args.backend == "ctranslate2":
        out["ct2_model"] = export_all(tiny["model"], tiny["model_config"], tiny["spm"], root / "export")["ct2_int8"]
    return out


def client(url: str, bodies: list[bytes], deadline: float, timeout_s: float, out: list) -> None:
    """Send bodies round-robin until the deadline; append (latency_s, status) per request."""
    i = 0
    while time.monotonic() < deadline:
        req = urllib.request.Request(url, data=bodies[i % len(bodies)], method="POST",
                                     headers={"Content-Type": "application/json"})
        start = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        except OSError:
            status = 0  # no answer (timeout, connection reset): lost
        out.append((time.monotonic() - start, status))
        i += 1


def run_load(url: str, sentences: list[str], args: argparse.Namespace) -> dict:
    k = args.sentences_per_request
    bodies = [json.dumps({"text": sentences[i: i + k]}).encode() for i in range(0, len(sentences) - k + 1, k)]
    results: list[list] = [[] for _ in range(args.clients)]
    deadline = time.monotonic() + args.duration_s
    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(url, bodies[c::args.clients] or bodies, deadline,
                                                       args.request_timeout_s, results[c]))
               for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    done = [r for rs in results for r in rs]
    ok = sorted(lat for lat, status in done if status == 200)
    q = statistics.quantiles(ok, n=100) if len(ok) >= 2 else [float("nan")] * 99
    return {"clients": args.clients, "sentences_per_request": k, "duration_s": wall, "requests_sent": len(done),
            "requests_ok": len(ok), "requests_lost": len(done) - len(ok), "requests_per_s": len(ok) / wall,
            "sentences_per_s": len(ok) * k / wall, "latency_p50_s": q[49], "latency_p99_s": q[98]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "wmt14"))
    p.add_argument("--work-dir", default="")
    p.add_argument("--backend", default="torch", choices=("torch", "ctranslate2"))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--sentences-per-request", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--out", default="")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import ray
    from ray import serve

    from pipeline.serve.app import build_app
    from tests.support.procs import free_port

    sentences = (Path(args.data) / "newstest2014.en").read_text(encoding="utf-8").splitlines()[:400]
    with tempfile.TemporaryDirectory() as tmp:
        app = build_app(app_args(args, Path(tmp)))
        ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(app, name="translation", route_prefix="/")
            url = f"http://127.0.0.1:{port}/translate"
            run_load(url, sentences[:8], argparse.Namespace(**{**vars(args), "clients": 1, "duration_s": 2.0}))
            res = {"backend": args.backend, "replicas": args.replicas, "max_batch_size": args.max_batch_size,
                   "beam_size": args.beam, **run_load(url, sentences, args)}
        finally:
            serve.shutdown()
            ray.shutdown()
    log.info("%d clients, %.0f s: %.1f requests/s, %.1f sentences/s, p50 %.3f s, p99 %.3f s; "
             "%d sent, %d answered 200, %d lost", res["clients"], res["duration_s"], res["requests_per_s"],
             res["sentences_per_s"], res["latency_p50_s"], res["latency_p99_s"], res["requests_sent"],
             res["requests_ok"], res["requests_lost"])
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
