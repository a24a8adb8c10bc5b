"""The hang report's load on the rendezvous store, and its latency, with simulated ranks
(pretrain/faults/watchdog.py: Channel and Watchdog; docs/reliability.md, "The store's load").

One TCPStore master on 127.0.0.1, in a process of its own (as torchrun's agent hosts the rendezvous
store), and N simulated ranks in worker processes, many ranks each. Every rank is a real Watchdog
with a client connection of its own to the store (as distributed.side_store makes it: a PrefixStore
over a TCPStore client) and a real Channel: the watchdog's own threads and code, not a copy. For
each world size it measures:

- between reports: the requests per second the watchdogs send the store (counted at each client),
  the store process's CPU share, and how long a bystander client's `set` + `get` of an unrelated key
  takes (p50 / p99 / max): what the rendezvous, or anything else on that store, waits;
- reports: rank 0 waits in a collective past its timeout and asks for a report, while the other
  ranks are making progress, so that every rank answers and the verdict is "no hang" (the run goes
  on, and the next report can be asked). Per report: from the ask to each rank's answer (p50 / max
  over the ranks: when each rank saw the request), to the verdict (the asking rank has every answer,
  at most REPORT_WAIT_S), and from the verdict to the last rank that reads it; the requests the
  report cost the store; the bystander's times during the reports.

    python bench/bench_hang_store.py                                   # 256, 1024, 4096 ranks
    python bench/bench_hang_store.py --ranks 256 4096 --code /tmp/resilience_old.py --json old.json

`--code` loads another version of pretrain/faults/watchdog.py (a copy of an older one, say) in the
workers, to compare before and after on the same machine. Simulation choices (docs/reliability.md
names them): the watchdog samples its main thread every --poll-s seconds (0.5) instead of 50 times
a second, the ranks of a worker start out of step, and the "is the main thread in a collective" test
answers no without looking (with hundreds of ranks in one process it would walk every thread's
frames, a cost one rank per process never has). None of these touches the store, and a poll
interval equal to the old code's LOOK_S (0.5 s) leaves that code's requests at their cadence (the
old watchdog looked for a request at its samples). Workers run at nice 10: on a cluster the ranks
do not share the store's cores, here 4,096 ranks' threads would starve it. Each rank's connection
times out as distributed.side_store's does (STORE_TIMEOUT_S). A TCPStore connect looks up the name
of its socket's address (::ffff:127.0.0.1 here), which waits for the resolver's timeout (5 s) where
no DNS server answers, as in the sandbox these figures come from: the bench sets
RES_OPTIONS="timeout:1 attempts:1" unless it is set. Everything still shares this machine's cores:
at large N the simulated ranks' own work (Python threads, the GIL) slows what they measure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFIX = "pretrain/hangs/bench/"


# -- the store process
def serve() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    print(store.port, flush=True)
    sys.stdin.read()  # until the parent closes it (or dies)


def _client(port: int, timeout_s: float = 60.0):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


# -- a worker: ranks [first, first + count) of a world of `world`
class Counted:
    """A store that counts the requests made through it and through its clones."""

    def __init__(self, store, counts: list, rank: int):
        self.store, self.counts, self.rank = store, counts, rank

    def clone(self):
        return Counted(self.store.clone(), self.counts, self.rank)

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.counts[self.rank] += 1
            return method(*args, **kwargs)

        return counted


def worker(args) -> None:
    import torch.distributed as dist

    threading.stack_size(512 * 1024)
    os.nice(10)  # (the store and the bystander first: on a cluster the ranks are not on the store's cores)
    spec = importlib.util.spec_from_file_location("bench_resilience", args.code)
    R = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(R)
    R.POLL_S = args.poll_s
    R._in_collective = lambda: False

    class Os:  # a verdict of hang ends its rank's watchdog thread, not the worker's other ranks
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def _exit(code):
            raise SystemExit(code)

    R.os = Os()
    R.Watchdog._write_stacks = lambda self, head: None  # (file I/O: not what is measured)

    ranks = range(args.first, args.first + args.count)
    counts = [0] * args.count  # requests per local rank
    events: dict = {}  # report -> {"ask": t, "publish": t, "answers": [t], "verdicts": [t]}

    def event(g: int) -> dict:
        return events.setdefault(g, {"ask": None, "publish": None, "line": None, "answers": [], "verdicts": []})

    class Timed(R.Channel):
        """The real channel, with the time of each rank's steps in a report noted."""

        def __init__(self, store, rank):
            super().__init__(store)
            self.rank, self.seen = rank, set()

        def ask(self, g, *rest):
            t = time.monotonic()
            first = super().ask(g, *rest)
            if first:
                event(g)["ask"] = t
            return first

        def answer(self, g, rank, head):
            event(g)["answers"].append(time.monotonic())
            return super().answer(g, rank, head)

        def publish(self, g, line):
            super().publish(g, line)
            event(g)["publish"], event(g)["line"] = time.monotonic(), line

        def verdict(self, g, *rest):
            line = super().verdict(g, *rest)
            if line is not None and g not in self.seen:  # (the first time this rank reads it)
                self.seen.add(g)
                event(g)["verdicts"].append(time.monotonic())
            return line

    print(json.dumps({"up": args.first}), flush=True)
    sys.stdin.readline()  # the parent starts one worker's ranks at a time (no storm of connects)
    with ThreadPoolExecutor(16) as pool:
        stores = list(pool.map(lambda r: dist.PrefixStore(PREFIX, _client(args.port, R.STORE_TIMEOUT_S)), ranks))
    hosts = [f"node{r // 8}" for r in range(args.world)]
    tmp = Path(tempfile.mkdtemp(prefix="bench_hang_store_"))
    dogs = []
    for i, r in enumerate(ranks):
        dog = R.Watchdog(tmp, r, hosts, 0.0, 1800.0, Timed(Counted(stores[i], counts, i), r))
        dog.mark("forward/backward", 1)
        dogs.append(dog)
        time.sleep(args.poll_s / args.count)  # (ranks in other processes do not sample in step)
        if i % 32 == 31 or i == args.count - 1:  # a batch at a time: each rank makes its first request
            while not all(counts[:i + 1]):  # (the old code's look, the new one's wait for a call)
                time.sleep(0.05)
    print(json.dumps({"ready": args.count}), flush=True)

    def progress():  # the other ranks make progress: a report finds none of them hung
        while True:
            for dog in dogs[1:] if args.first == 0 else dogs:
                dog.progress()
            time.sleep(1.0)

    threading.Thread(target=progress, daemon=True).start()
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "counts":
            reply = {"requests": sum(counts)}
        elif cmd[0] == "fire":  # rank 0: waits in a collective, past its timeout
            dogs[0].mark("collective", int(cmd[1]))
            dogs[0].since -= 3600
            reply = {"fired": int(cmd[1])}
        elif cmd[0] == "report":
            reply = event(int(cmd[1]))
        else:
            break
        print(json.dumps(reply), flush=True)
    os._exit(0)  # (no close: the store goes next)


# -- the parent
class Proc:
    def __init__(self, argv: list[str], log: Path):
        self.log = open(log, "w")
        self.p = subprocess.Popen([sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, cwd=REPO)

    def ask(self, line: str) -> dict:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.read()

    def read(self) -> dict:
        out = self.p.stdout.readline()
        if not out:
            raise RuntimeError(f"a worker ended (exit {self.p.wait()}); its stderr: {self.log.name}")
        return json.loads(out)

    def end(self) -> None:
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.log.close()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bystander(threading.Thread):
    """An unrelated client of the same store: a set and a get every 50 ms, timed (one that fails,
    after the client's 60 s, counts as the time it took)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.phase, self.times, self.failed, self.stop = port, None, {}, Counter(), False

    def run(self) -> None:
        store, i = _client(self.port), 0
        while not self.stop:
            i += 1
            start = time.monotonic()
            try:
                store.set("bystander/key", str(i))
                store.get("bystander/key")
            except Exception:  # noqa: BLE001
                self.failed[self.phase] += 1
                store = _client(self.port)
            if self.phase:
                self.times.setdefault(self.phase, []).append(time.monotonic() - start)
            time.sleep(0.05)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_world(n: int, args, logs: Path) -> dict:
    store = Proc(["--serve"], logs / f"store-{n}.log")
    port = int(store.p.stdout.readline())
    per = -(-n // args.workers)
    workers = [Proc(["--worker", "--port", str(port), "--first", str(lo), "--count", str(min(per, n - lo)),
                     "--world", str(n), "--code", str(args.code), "--poll-s", str(args.poll_s)],
                    logs / f"worker-{n}-{lo}.log") for lo in range(0, n, per)]
    bystander = Bystander(port)
    try:
        for w in workers:
            w.read()  # up
        t = time.monotonic()
        for w in workers:
            w.ask("start")  # ready
        setup_s = time.monotonic() - t
        bystander.start()
        time.sleep(2.0)  # (settle)
        # between reports
        bystander.phase = "steady"
        c0, s0, t0 = sum(w.ask("counts")["requests"] for w in workers), cpu_s(store.p.pid), time.monotonic()
        time.sleep(args.steady_s)
        c1, s1, t1 = sum(w.ask("counts")["requests"] for w in workers), cpu_s(store.p.pid), time.monotonic()
        # reports
        bystander.phase = "reports"
        reports, r0, rs0, rt0 = [], c1, cpu_s(store.p.pid), time.monotonic()
        for g in range(1, args.reports + 1):
            workers[0].ask(f"fire {g}")
            deadline = time.monotonic() + 120
            while True:
                time.sleep(0.5)
                parts = [w.ask(f"report {g}") for w in workers]
                ev = {"ask": parts[0]["ask"], "publish": parts[0]["publish"], "line": parts[0]["line"],
                      "answers": [a for p in parts for a in p["answers"]],
                      "verdicts": [v for p in parts for v in p["verdicts"]]}
                if ev["publish"] is not None and len(ev["verdicts"]) >= n - 1 or time.monotonic() > deadline:
                    break
            seen = [a - ev["ask"] for a in ev["answers"]] if ev["ask"] else []
            reports.append({"answered": len(ev["answers"]), "read_verdict": len(ev["verdicts"]), "verdict": ev["line"],
                            "seen_min_s": min(seen, default=float("nan")),
                            "seen_p50_s": pct(seen, 0.5), "seen_max_s": max(seen, default=float("nan")),
                            "verdict_s": ev["publish"] - ev["ask"] if ev["publish"] and ev["ask"] else None,
                            "out_s": max(ev["verdicts"]) - ev["publish"] if ev["verdicts"] and ev["publish"] else None})
            if ev["line"] != "":  # a hang named (or no verdict): the simulated job is over
                break
            time.sleep(1.0)
        r1, rs1, rt1 = sum(w.ask("counts")["requests"] for w in workers), cpu_s(store.p.pid), time.monotonic()
    finally:
        bystander.stop = True
        for w in workers:
            w.end()
        store.end()
    steady, during = bystander.times.get("steady", []), bystander.times.get("reports", [])
    med = lambda key: statistics.median([r[key] for r in reports if r[key] is not None] or [float("nan")])  # noqa: E731
    return {
        "ranks": n, "code": str(args.code), "setup_s": round(setup_s, 1),
        "steady_requests_per_s": (c1 - c0) / (t1 - t0), "steady_store_cpu": (s1 - s0) / (t1 - t0),
        "bystander_steady_ms": [1000 * pct(steady, q) for q in (0.5, 0.99)] + [1000 * max(steady, default=0)],
        "bystander_failed": dict(bystander.failed),
        "reports": reports,
        "seen_min_s": med("seen_min_s"), "seen_p50_s": med("seen_p50_s"), "seen_max_s": med("seen_max_s"),
        "verdict_s": med("verdict_s"), "out_s": med("out_s"),
        "requests_per_report": (r1 - r0) / len(reports), "reports_requests_per_s": (r1 - r0) / (rt1 - rt0),
        "reports_store_cpu": (rs1 - rs0) / (rt1 - rt0), "store_cpu_s_per_report": (rs1 - rs0) / len(reports),
        "bystander_reports_ms": [1000 * pct(during, 0.5), 1000 * pct(during, 0.99), 1000 * max(during, default=0)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--workers", type=int, default=16, help="simulating processes")
    ap.add_argument("--steady-s", type=float, default=10.0)
    ap.add_argument("--reports", type=int, default=3)
    ap.add_argument("--poll-s", type=float, default=0.5, help="the watchdog's sampling interval, simulated")
    ap.add_argument("--code", type=Path, default=REPO / "pretrain" / "faults" / "watchdog.py",
                    help="the resilience module to run (default: this tree's)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve()
    if args.worker:
        return worker(args)
    args.code = args.code.resolve()
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # (before any connect; inherited)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_hang_store_") as tmp:
        for n in args.ranks:
            r = run_world(n, args, Path(tmp))
            results.append(r)
            print(f"{n:5d} ranks ({r['setup_s']:.0f} s to connect): between reports {r['steady_requests_per_s']:7.0f} "
                  f"requests/s, store CPU {100 * r['steady_store_cpu']:4.0f}%, bystander set+get p50/p99/max "
                  f"{'/'.join(f'{x:.1f}' for x in r['bystander_steady_ms'])} ms", flush=True)
            print(f"      a report: the ranks saw it after min {r['seen_min_s']:.3f} / p50 {r['seen_p50_s']:.3f} / max "
                  f"{r['seen_max_s']:.3f} s; verdict at {r['verdict_s']:.2f} s, read by all {r['out_s']:.3f} s later; "
                  f"{r['requests_per_report']:.0f} requests; store CPU {r['store_cpu_s_per_report']:.2f} s; bystander "
                  f"p50/p99/max {'/'.join(f'{x:.1f}' for x in r['bystander_reports_ms'])} ms "
                  f"({', '.join(str(x['answered']) for x in r['reports'])} answers)", flush=True)
            for i, x in enumerate(r["reports"], 1):
                if x["verdict"] != "":
                    print(f"      report {i}: {'no verdict' if x['verdict'] is None else x['verdict'][:400]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
