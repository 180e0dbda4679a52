"""Throughput and latency of the Ray Serve app (pipeline/serve/app.py) under N concurrent clients.

Starts its own local Ray and the app on 127.0.0.1, then N client threads each send
``POST /translate`` requests of ``--sentences-per-request`` newstest2014 sentences back to back
for ``--duration-s`` seconds (bounded: every request has a timeout; no request is started after
the deadline). A ``--bad-fraction`` of the requests are client mistakes (bad JSON, an unknown
key, a lone surrogate, too many sentences, JSON nested too deep), which must get a 4xx; a 503
(the server's backpressure) makes that client wait its Retry-After, as a polite client does.
Prints sentences/s (of the 200s), p50 / p99 latency of the 200s, the count of each status, and
requests without an answer (a timeout, a reset): counted and reported, never hidden.

    .venv/bin/python benchmarks/serve_bench.py [--clients 32] [--bad-fraction 0.2] [--duration-s 30]
        [--backend torch|ctranslate2] [--max-batch-size 16] [--replicas 1] [--config configs/local.toml]

Weights: the model of ``--config`` (its DAG plan's outputs), else the tiny model of
tests/support/tiny_model.py trained here (~30 s) and exported here.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import typing
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.config import Backend  # noqa: E402

log = logging.getLogger("serve_bench")


def app_args(args: argparse.Namespace, root: Path) -> dict:
    """build_app's arguments: the model of --config, else a tiny model trained and exported in ``root``."""
    common = {"backend": args.backend, "max_batch_size": args.max_batch_size, "num_replicas": args.replicas,
              "beam_size": args.beam, "max_sentences_per_request": MAX_SENTENCES}
    if args.config:
        return {"config": args.config, **common}
    from pipeline.decoding.conversion import export_all
    from tests.support.tiny_model import train_tiny_model

    tiny = train_tiny_model(Path(args.data), root / "tiny")
    out = {"model_dir": tiny["model_dir"], "spm": tiny["spm"], **common}
    if args.backend == "ctranslate2":
        out["ct2_model"] = export_all(tiny["model"], tiny["model_config"], tiny["spm"], root / "export")["ct2_int8"]
    return out


MAX_SENTENCES = 64
# Client mistakes, each answered with a 4xx by pipeline/serve/request.py (never a 500).
BAD_BODIES = (b'{"text": ["a", ', b'{"text": ["Hello."], "beam": 100}', b'{"text": ["\\ud800"]}',
              json.dumps({"text": ["a"] * (MAX_SENTENCES + 1)}).encode(), b'{"text": [[[[["a"]]]]]}')


def client(url: str, good: list[bytes], bad_every: int, deadline: float, timeout_s: float, out: list,
           offset: int = 0, attention: list[bytes] = (), attention_every: int = 0) -> None:
    """Send bodies until the deadline, every ``bad_every``-th a bad one (0: none) and every
    ``attention_every``-th an ``"attention": true`` one (0: none); append (kind, latency_s, status)
    per request, kind "good" (a plain translation), "attention" or "bad"."""
    i = 0
    while time.monotonic() < deadline:
        is_good = not (bad_every and i % bad_every == bad_every - 1)
        kind = "good" if is_good else "bad"
        body = good[i % len(good)] if is_good else BAD_BODIES[(i // bad_every + offset) % len(BAD_BODIES)]
        if is_good and attention_every and (i + offset) % attention_every == attention_every - 1:
            kind, body = "attention", attention[i % len(attention)]
        req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
        start, wait_s = time.monotonic(), 0.0
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
            if status == 503:
                wait_s = float(e.headers.get("Retry-After") or 1)
        except OSError:
            status = 0  # no answer (timeout, connection reset): lost
        out.append((kind, time.monotonic() - start, status))
        time.sleep(max(0.0, min(wait_s, deadline - time.monotonic())))
        i += 1


def run_load(url: str, sentences: list[str], args: argparse.Namespace) -> dict:
    """``args.clients`` client threads for ``args.duration_s``; the counts and latencies of their answers."""
    k = args.sentences_per_request
    results: list[list] = [[] for _ in range(args.clients)]
    deadline = time.monotonic() + args.duration_s
    start = time.monotonic()
    good = [json.dumps({"text": sentences[i: i + k]}).encode() for i in range(0, len(sentences) - k + 1, k)]
    attention = [json.dumps({"text": [t], "attention": True}).encode() for t in sentences if 0 < len(t) < 200]
    bad_every = round(1 / args.bad_fraction) if args.bad_fraction > 0 else 0
    att_frac = getattr(args, "attention_fraction", 0.0)
    attention_every = round(1 / att_frac) if att_frac > 0 else 0
    threads = [threading.Thread(target=client, args=(url, good[c::args.clients] or good, bad_every, deadline,
                                                       args.request_timeout_s, results[c], c, attention,
                                                       attention_every))
               for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    done = [r for rs in results for r in rs]
    ok = sorted(lat for kind, lat, status in done if status == 200 and kind == "good")
    q = statistics.quantiles(ok, n=100) if len(ok) >= 2 else [float("nan")] * 99
    att = sorted(lat for kind, lat, status in done if status == 200 and kind == "attention")
    qa = statistics.quantiles(att, n=100) if len(att) >= 2 else [float("nan")] * 99
    bad = [status for kind, _, status in done if kind == "bad"]
    return {"clients": args.clients, "sentences_per_request": k, "bad_fraction": args.bad_fraction,
            "attention_fraction": att_frac,
            "duration_s": wall, "requests_sent": len(done), "requests_ok": len(ok),
            "statuses": dict(sorted(collections.Counter(str(s) for _, _, s in done).items())),
            "bad_requests_sent": len(bad), "bad_requests_4xx": sum(400 <= s < 500 for s in bad),
            "good_requests_not_200": sum(s != 200 for kind, _, s in done if kind != "bad"),
            "requests_unanswered": sum(s == 0 for _, _, s in done),
            "requests_500": sum(s == 500 for _, _, s in done), "requests_per_s": len(ok) / wall,
            "sentences_per_s": len(ok) * k / wall, "latency_p50_s": q[49], "latency_p99_s": q[98],
            "attention_ok": len(att), "attention_p50_s": qa[49], "attention_p99_s": qa[98]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=os.environ.get("WMT14_DATA") or str(REPO.parent / "shared" / "data" / "wmt14"))
    p.add_argument("--config", default="", help="serve this pipeline config's model (else a tiny one)")
    p.add_argument("--bad-fraction", type=float, default=0.2, help="share of requests that are client mistakes")
    p.add_argument("--backend", default="torch", choices=typing.get_args(Backend))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--sentences-per-request", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--attention-fraction", type=float, default=0.0,
                   help="> 0: two rounds, without and then with this share of \"attention\": true requests; the "
                        "plain requests' p99 of the second over the first (the target: <= 1.5x at 0.2, 16 clients)")
    p.add_argument("--out", default="")
    return p.parse_args()


def measure(url: str, sentences: list[str], args: argparse.Namespace) -> dict:
    """A 2 s warm-up by one client, then the load without attention requests, then (with
    --attention-fraction) the same load with them and the plain requests' latency ratios."""
    from pipeline.serve.app import ServeSettings

    run_load(url, sentences[:8], argparse.Namespace(**{**vars(args), "clients": 1, "duration_s": 2.0,
                                                       "bad_fraction": 0.0}))
    limits = ServeSettings()
    res = {"backend": args.backend, "replicas": args.replicas, "max_batch_size": args.max_batch_size,
           "max_ongoing_requests": limits.max_ongoing_requests,
           "max_queued_requests": limits.max_queued_requests,
           "beam_size": args.beam,
           **run_load(url, sentences, argparse.Namespace(**{**vars(args), "attention_fraction": 0.0}))}
    if args.attention_fraction > 0:  # the same load again, a share of it asking for attention
        res["with_attention"] = run_load(url, sentences, args)
        res["plain_p99_ratio"] = res["with_attention"]["latency_p99_s"] / res["latency_p99_s"]
        res["plain_p50_ratio"] = res["with_attention"]["latency_p50_s"] / res["latency_p50_s"]
    return res


def log_summary(res: dict) -> None:
    log.info("%d clients (%.0f%% bad requests), %.0f s: %.1f sentences/s, p50 %.3f s, p99 %.3f s; statuses %s; "
             "%d bad -> %d 4xx; %d unanswered", res["clients"], 100 * res["bad_fraction"], res["duration_s"],
             res["sentences_per_s"], res["latency_p50_s"], res["latency_p99_s"], res["statuses"],
             res["bad_requests_sent"], res["bad_requests_4xx"], res["requests_unanswered"])
    if "with_attention" in res:
        w = res["with_attention"]
        log.info("with %.0f%% attention requests: plain p50 %.3f s (%.2fx), p99 %.3f s (%.2fx); attention p50 %.3f s, "
                 "p99 %.3f s; %d unanswered, %d 500s", 100 * w["attention_fraction"], w["latency_p50_s"],
                 res["plain_p50_ratio"], w["latency_p99_s"], res["plain_p99_ratio"], w["attention_p50_s"],
                 w["attention_p99_s"], w["requests_unanswered"], w["requests_500"])


def main() -> None:
    args = parse_args()
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
            res = measure(f"http://127.0.0.1:{port}/translate", sentences, args)
        finally:
            serve.shutdown()
            ray.shutdown()
    log_summary(res)
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
