"""Throughput and latency of the Ray Serve app (pipeline/serve/app.py) under N concurrent clients.

Starts its own local Ray and the app on 127.0.0.1, then N client threads each send
``POST /translate`` requests of ``--sentences-per-request`` newstest2014 sentences back to back
for ``--duration-s`` seconds (bounded: every request has a timeout; no request is started after
the deadline). A ``--bad-fraction`` of the requests are client mistakes (bad JSON, an unknown
key, a lone surrogate, too many sentences, JSON nested too deep), which must get a 4xx; a 503
(the server's backpressure) makes that client wait its Retry-After, as a polite client does.
Prints sentences/s (of the 200s), p50 / p99 latency of the 200s, the count of each status, and
requests without an answer (a timeout, a reset): counted and reported, never hidden.
With ``--attention-fraction`` / ``--explain-fraction``, the same load runs again with that share of
the good requests asking for the page's ``"attention": true`` / ``"explain"`` (one row of one head's
computation), and the plain requests' p50 / p99 of each round are printed side by side.

    .venv/bin/python benchmarks/serve_bench.py [--clients 32] [--bad-fraction 0.2] [--duration-s 30]
        [--backend torch|ctranslate2] [--max-batch-size 16] [--replicas 1] [--config configs/local.toml]
        [--attention-fraction 0.2] [--explain-fraction 0.2]

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
    from tests.support.tiny_model import news_pairs, train_tiny_model

    tiny = train_tiny_model(news_pairs(Path(args.data)), root / "tiny")
    out = {"model_dir": tiny["model_dir"], "spm": tiny["spm"], **common}
    if args.backend == "ctranslate2":
        out["ct2_model"] = export_all(tiny["model"], tiny["model_config"], tiny["spm"], root / "export")["ct2_int8"]
    return out


MAX_SENTENCES = 64
# Client mistakes, each answered with a 4xx by pipeline/serve/request.py (never a 500).
BAD_BODIES = (b'{"text": ["a", ', b'{"text": ["Hello."], "beam": 100}', b'{"text": ["\\ud800"]}',
              json.dumps({"text": ["a"] * (MAX_SENTENCES + 1)}).encode(), b'{"text": [[[[["a"]]]]]}')


def client(url: str, good: list[bytes], bad_every: int, deadline: float, timeout_s: float, out: list,
           offset: int = 0, special: tuple[str, list[bytes]] = ("", []), special_every: int = 0) -> None:
    """Send bodies until the deadline, every ``bad_every``-th a bad one (0: none) and every
    ``special_every``-th one of ``special`` = (its kind, its bodies): ``"attention": true`` or
    ``"explain"`` requests (0: none); append (kind, latency_s, status) per request, kind "good"
    (a plain translation), "bad" or the special kind."""
    i = 0
    while time.monotonic() < deadline:
        is_good = not (bad_every and i % bad_every == bad_every - 1)
        kind = "good" if is_good else "bad"
        body = good[i % len(good)] if is_good else BAD_BODIES[(i // bad_every + offset) % len(BAD_BODIES)]
        if is_good and special_every and (i + offset) % special_every == special_every - 1:
            kind, body = special[0], special[1][i % len(special[1])]
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


def attention_bodies(sentences: list[str]) -> list[bytes]:
    """One-sentence ``"attention": true`` requests (the page's translate button)."""
    return [json.dumps({"text": [t], "attention": True}).encode() for t in sentences if 0 < len(t) < 200]


EXPLAIN_KINDS = ("cross", "encoder_self", "decoder_self")


def explain_bodies(sentences: list[str]) -> list[bytes]:
    """One-sentence ``"explain"`` requests (the page's click on a row): each attention kind in turn, layer 0,
    head 0, the first query (a position every sentence has)."""
    return [json.dumps({"text": [t], "explain": {"kind": EXPLAIN_KINDS[i % 3], "layer": 0, "head": 0, "query": 0}})
            .encode() for i, t in enumerate(t for t in sentences if 0 < len(t) < 200)]


def run_load(url: str, sentences: list[str], args: argparse.Namespace) -> dict:
    """``args.clients`` client threads for ``args.duration_s``; the counts and latencies of their answers."""
    k = args.sentences_per_request
    results: list[list] = [[] for _ in range(args.clients)]
    deadline = time.monotonic() + args.duration_s
    start = time.monotonic()
    good = [json.dumps({"text": sentences[i: i + k]}).encode() for i in range(0, len(sentences) - k + 1, k)]
    bad_every = round(1 / args.bad_fraction) if args.bad_fraction > 0 else 0
    att_frac, exp_frac = getattr(args, "attention_fraction", 0.0), getattr(args, "explain_fraction", 0.0)
    special = ("explain", explain_bodies(sentences)) if exp_frac > 0 else ("attention", attention_bodies(sentences))
    special_every = round(1 / (exp_frac or att_frac)) if (exp_frac or att_frac) > 0 else 0
    threads = [threading.Thread(target=client, args=(url, good[c::args.clients] or good, bad_every, deadline,
                                                       args.request_timeout_s, results[c], c, special,
                                                       special_every))
               for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    done = [r for rs in results for r in rs]
    ok = sorted(lat for kind, lat, status in done if status == 200 and kind == "good")
    q = statistics.quantiles(ok, n=100) if len(ok) >= 2 else [float("nan")] * 99
    att = sorted(lat for kind, lat, status in done if status == 200 and kind == special[0])
    qa = statistics.quantiles(att, n=100) if len(att) >= 2 else [float("nan")] * 99
    bad = [status for kind, _, status in done if kind == "bad"]
    return {"clients": args.clients, "sentences_per_request": k, "bad_fraction": args.bad_fraction,
            "attention_fraction": att_frac, "explain_fraction": exp_frac, "special": special[0] if special_every else "",
            "duration_s": wall, "requests_sent": len(done), "requests_ok": len(ok),
            "statuses": dict(sorted(collections.Counter(str(s) for _, _, s in done).items())),
            "bad_requests_sent": len(bad), "bad_requests_4xx": sum(400 <= s < 500 for s in bad),
            "good_requests_not_200": sum(s != 200 for kind, _, s in done if kind != "bad"),
            "requests_unanswered": sum(s == 0 for _, _, s in done),
            "requests_500": sum(s == 500 for _, _, s in done), "requests_per_s": len(ok) / wall,
            "sentences_per_s": len(ok) * k / wall, "latency_p50_s": q[49], "latency_p99_s": q[98],
            "special_ok": len(att), "special_p50_s": qa[49], "special_p99_s": qa[98]}


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
    p.add_argument("--explain-fraction", type=float, default=0.0,
                   help="> 0: a round with this share of \"explain\" requests (one row of one head's computation) "
                        "after the plain round; the plain requests' p99 of that round over the plain one's")
    p.add_argument("--out", default="")
    return p.parse_args()


def measure(url: str, sentences: list[str], args: argparse.Namespace) -> dict:
    """A 2 s warm-up by one client, then the load of plain requests only, then (with
    --attention-fraction, --explain-fraction) the same load with that share of attention / explain
    requests, each round with its plain requests' latency over the plain-only round's."""
    from pipeline.serve.app import ServeSettings

    plain = {"attention_fraction": 0.0, "explain_fraction": 0.0}
    run_load(url, sentences[:8], argparse.Namespace(**{**vars(args), **plain, "clients": 1, "duration_s": 2.0,
                                                       "bad_fraction": 0.0}))
    limits = ServeSettings()
    res = {"backend": args.backend, "replicas": args.replicas, "max_batch_size": args.max_batch_size,
           "max_ongoing_requests": limits.max_ongoing_requests,
           "max_queued_requests": limits.max_queued_requests,
           "beam_size": args.beam,
           **run_load(url, sentences, argparse.Namespace(**{**vars(args), **plain}))}
    for kind in ("attention", "explain"):  # the same load again, a share of it asking for attention / explanations
        frac = getattr(args, f"{kind}_fraction")
        if frac > 0:
            other = "explain" if kind == "attention" else "attention"
            w = res[f"with_{kind}"] = run_load(url, sentences, argparse.Namespace(**{**vars(args),
                                                                                   f"{other}_fraction": 0.0}))
            w["plain_p99_ratio"] = w["latency_p99_s"] / res["latency_p99_s"]
            w["plain_p50_ratio"] = w["latency_p50_s"] / res["latency_p50_s"]
    return res


def log_summary(res: dict) -> None:
    log.info("%d clients (%.0f%% bad requests), %.0f s: %.1f sentences/s, p50 %.3f s, p99 %.3f s; statuses %s; "
             "%d bad -> %d 4xx; %d unanswered", res["clients"], 100 * res["bad_fraction"], res["duration_s"],
             res["sentences_per_s"], res["latency_p50_s"], res["latency_p99_s"], res["statuses"],
             res["bad_requests_sent"], res["bad_requests_4xx"], res["requests_unanswered"])
    rounds = [("plain only", res)] + [(f"{100 * res[k][f'{k[5:]}_fraction']:.0f}% {k[5:]}", res[k])
                                       for k in ("with_attention", "with_explain") if k in res]
    if len(rounds) > 1:  # side by side: the plain requests' latency in each round
        log.info("%-16s %8s %8s %8s %8s %10s %10s %6s %6s", "round", "plain ok", "p50 s", "p99 s", "p99 x",
                 "other p50", "other p99", "500s", "lost")
        for name, w in rounds:
            log.info("%-16s %8d %8.3f %8.3f %8.2f %10.3f %10.3f %6d %6d", name, w["requests_ok"], w["latency_p50_s"],
                     w["latency_p99_s"], w.get("plain_p99_ratio", 1.0), w["special_p50_s"], w["special_p99_s"],
                     w["requests_500"], w["requests_unanswered"])


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
