#!/usr/bin/python3
"""Merges the Chrome traces of a fusedp run (--trace FILE: one file per rank) and splits each step's
time into compute, exposed communication and data wait.

    trace_report.py TRACE.json [MORE.json ...] [-o MERGED.json] [--per-step] [--png OUT.png [--steps N]]

For each step it takes the slowest replica (the one every other waits for in the step's collectives)
and splits its time, from the end of its previous step to the end of this one, into
    compute   the stages forward and backward, the loss and the optimizer, with a Cuda replica's
              weight gradients on its side stream (its branch lane) where they ran beyond those
    reduce    blocked on a gradient reduction: a blocking one, or the wait for those started during
              backward (the part backward did not hide): the exposed communication of the gradients
    sync      blocked in the small collectives of a step (loss, sample counts, parameters): mostly
              waiting for the slowest rank to arrive
    data      waiting for the next batch from the loader
    other     the rest (bookkeeping between stages, the training loop's own work)
and prints the median over the steps (every step with --per-step), then each rank's overlap: the
share of its reduction time hidden behind backward.

-o writes one trace of all ranks (open it in ui.perfetto.dev or chrome://tracing). Ranks on one
machine share its steady clock; traces from several machines are aligned on their system clocks
(each trace records both at its start), as good as the machines' clock synchronization.
--png draws the timeline of N steps (default 3) from the middle of the run (needs matplotlib: Debian
python3-matplotlib).

Exit status: 0 on success, 1 on a missing or malformed file (the message names the file).
"""

import argparse
import bisect
import json
import statistics
import sys

COMPUTE = {"forward", "loss", "backward", "optimizer"}
COMM_LANE = 1000  # replica r's reductions are on tid COMM_LANE + r (exec/trace.hpp)
BRANCH_LANE = 2000  # a Cuda replica r's weight gradients on its side stream: tid BRANCH_LANE + r
BETWEEN_STEPS = {"evaluate", "checkpoint"}  # not part of the next step's time
WAIT = {"wait"}
SYNC = {"collective"}


def fail(message):
    print(f"trace_report.py: error: {message}", file=sys.stderr)
    sys.exit(1)


def read_trace(path):
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        fail(f"{path}: {e.strerror}")
    except json.JSONDecodeError as e:
        fail(f"{path}: not JSON ({e})")
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        fail(f"{path}: not a Chrome trace (no traceEvents array)")
    other = doc.get("otherData")
    meta = other.get("fusedp") if isinstance(other, dict) else None
    if not isinstance(meta, dict):
        fail(f"{path}: not written by fusedp (no otherData.fusedp)")
    for key in ("rank", "world", "steady_origin_us", "system_origin_us"):
        if not isinstance(meta.get(key), (int, float)):
            fail(f"{path}: otherData.fusedp has no number '{key}'")
    return doc, meta


def merge(paths):
    """Every file's events on one clock, the fusedp metadata of each file."""
    docs = [(p,) + read_trace(p) for p in paths]
    hosts = {m.get("host", "") for _, _, m in docs}
    ranks = [m.get("rank") for _, _, m in docs]
    if len(set(ranks)) != len(ranks):
        fail("two files hold the same rank: " + ", ".join(f"{p} (rank {m.get('rank')})" for p, _, m in docs))
    world = max(m["world"] for _, _, m in docs)
    if len(docs) < world:
        print(f"trace_report.py: note: {len(docs)} of the run's {world} ranks' traces given", file=sys.stderr)
    events, metas = [], []
    for path, doc, meta in docs:
        # One machine: the steady clock is common. Several: move each file onto its system clock.
        shift = 0.0 if len(hosts) == 1 else meta["system_origin_us"] - meta["steady_origin_us"]
        for e in doc["traceEvents"]:
            if not isinstance(e, dict):
                fail(f"{path}: a trace event that is not an object")
            e = dict(e)
            if "ts" in e:
                e["ts"] = e["ts"] + shift
            if "id" in e:  # each file numbers its async pairs from 1: unique over the merged ranks
                e["id"] = f"{meta['rank']}.{e['id']}"
            events.append(e)
        metas.append(meta)
    return events, metas


def spans_of(events):
    """Complete spans per (pid, tid) as (begin, end, cat, name, args), sorted, and each replica's
    reductions per (pid, replica) as (begin, end)."""
    lanes, open_async, reduce_spans = {}, {}, {}
    try:
        for e in events:
            ph = e.get("ph")
            if ph == "X":
                b = e["ts"]
                lanes.setdefault((e["pid"], e["tid"]), []).append((b, b + e["dur"], e.get("cat", ""), e["name"], e.get("args", {})))
            elif ph == "b":
                open_async[(e["pid"], e["id"])] = e
            elif ph == "e":
                start = open_async.pop((e["pid"], e["id"]), None)
                if start is not None:
                    replica = start["tid"] - COMM_LANE if start["tid"] >= COMM_LANE else start["tid"]
                    reduce_spans.setdefault((e["pid"], replica), []).append((start["ts"], e["ts"]))
    except (KeyError, TypeError) as e:
        fail(f"a trace event lacks a field or has one of the wrong type ({e})")
    for spans in lanes.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
    return lanes, reduce_spans


def inside(spans, begins, begin, end):
    """The spans of a sorted lane (begins: their begin times) that lie within [begin, end]."""
    lo, hi = bisect.bisect_left(begins, begin), bisect.bisect_right(begins, end)
    return [s for s in spans[lo:hi] if s[1] <= end]


def union(intervals):
    out = []
    for b, e in sorted(intervals):
        if out and b <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([b, e])
    return out


def common(a, b):
    """The length of the intersection of two unions."""
    n, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        n += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return n


def step_splits(lanes):
    """{step number: [(total, compute, reduce, sync, data, other, pid, tid), ...]} over every replica lane."""
    out = {}
    begins = {key: [s[0] for s in spans] for key, spans in lanes.items()}
    for (pid, tid), spans in lanes.items():
        if tid >= COMM_LANE:
            continue
        steps = [s for s in spans if s[2] == "step"]
        # The loader is read by the process's own thread (lane 0), for every replica of the process.
        main = lanes.get((pid, 0), [])
        main_begins = begins.get((pid, 0), [])
        previous_end = None
        for begin, end, _, _, args in steps:
            children = inside(spans, begins[(pid, tid)], begin, end)
            wait = sum(s[1] - s[0] for s in children if s[2] in WAIT)
            sync = sum(s[1] - s[0] for s in children if s[2] in SYNC)
            # The replica's own compute spans do not overlap (they nest in the step); its branch lane's
            # run beside them: counted where they cover time the lane spent on neither compute nor a
            # wait or collective.
            busy = [(s[0], s[1]) for s in children if s[2] in COMPUTE]
            branch = lanes.get((pid, BRANCH_LANE + tid), [])
            busy += [(s[0], s[1]) for s in inside(branch, begins.get((pid, BRANCH_LANE + tid), []), begin, end)
                     if s[2] in COMPUTE]
            covered = union(busy)
            compute = sum(e - b for b, e in covered) - common(
                covered, union([(s[0], s[1]) for s in children if s[2] in WAIT or s[2] in SYNC]))
            data = 0.0
            start = begin
            if previous_end is not None:
                between = inside(main, main_begins, previous_end, begin)
                breaks = [v for v in between if v[2] in BETWEEN_STEPS]
                waits = [s for s in between if s[2] == "data"
                         and not any(v[0] <= s[0] and s[1] <= v[1] for v in breaks)]
                data = sum(s[1] - s[0] for s in waits)
                # From the previous step's end, unless an evaluation or a save lies between (an epoch's
                # end without either is not seen: its time is in this step's "other").
                start = begin - data if breaks else previous_end
            total = end - start
            other = max(0.0, total - compute - wait - sync - data)
            out.setdefault(args.get("step", len(out)), []).append((total, compute, wait, sync, data, other, pid, tid))
            previous_end = end
    return out


def report(events, metas, per_step):
    lanes, reduce_spans = spans_of(events)
    splits = step_splits(lanes)
    if not splits:
        fail("no step spans in the trace (was it written by a training run?)")
    rows = []
    for step in sorted(splits):
        rows.append((step,) + max(splits[step], key=lambda r: r[0]))
    world = max(m.get("world", 1) for m in metas)
    replicas = len({(r[6], r[7]) for step in splits.values() for r in step})
    print(f"{len(rows)} steps, {world} process(es), {replicas} replica(s); times in ms, the slowest replica of each step")
    names = ("total", "compute", "reduce", "sync", "data", "other")
    print(f"{'step':>8} " + " ".join(f"{n:>9}" for n in names) + ("  slowest" if per_step else ""))
    if per_step:
        for r in rows:
            print(f"{r[0]:>8} " + " ".join(f"{v/1e3:9.3f}" for v in r[1:7]) + f"  rank {r[7]} lane {r[8]}")
    med = [statistics.median(r[i] for r in rows) for i in range(1, 7)]
    total = sum(r[1] for r in rows)
    parts = [sum(r[i] for r in rows) for i in range(2, 7)]
    print(f"{'median':>8} " + " ".join(f"{v/1e3:9.3f}" for v in med))
    if total > 0:
        print(f"{'share':>8} {'':>9} " + " ".join(f"{100*p/total:8.1f}%" for p in parts))
    for meta in sorted(metas, key=lambda m: m["rank"]):
        pid = meta["rank"]
        # As the run prints it: per replica, the time its reductions were in flight (buckets in flight
        # together count once) and the part of it the replica waited.
        reduce_us = wait_us = 0.0
        for (p, replica), spans in reduce_spans.items():
            if p != pid:
                continue
            r = union(spans)
            reduce_us += sum(e - b for b, e in r)
            wait_us += common(r, union([(s[0], s[1]) for s in lanes.get((pid, replica), []) if s[2] == "wait"]))
        if reduce_us > 0:
            hidden = max(0.0, min(1.0, 1 - wait_us / reduce_us))
            print(f"rank {pid}: gradient reduction {reduce_us/1e3:.1f} ms, exposed {wait_us/1e3:.1f} ms: "
                  f"{100*hidden:.0f}% hidden behind backward")
        else:
            print(f"rank {pid}: no gradient reduction")
    return rows, lanes, reduce_spans


def draw(path, rows, lanes, reduce_spans, steps):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("--png needs matplotlib (Debian: apt-get install python3-matplotlib)")
    step_lane = {}
    for (pid, tid), spans in lanes.items():
        for s in spans:
            if s[2] == "step":
                step_lane.setdefault(s[4].get("step"), []).append(s)
    numbers = sorted(step_lane)
    middle = max(0, len(numbers) // 2 - steps // 2)
    chosen = numbers[middle:middle + steps]
    begin = min(s[0] for n in chosen for s in step_lane[n])
    end = max(s[1] for n in chosen for s in step_lane[n])
    begin -= 0.05 * (end - begin)
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "loss": "#8172b3", "optimizer": "#55a868",
              "wait": "#c44e52", "collective": "#da8bc3", "data": "#937860", "reduce": "#64b5cd"}
    rows_y = []
    for (pid, tid) in sorted(k for k in lanes if k[1] < COMM_LANE):
        rows_y.append((f"rank {pid} replica {tid}", [s for s in lanes[(pid, tid)] if s[1] >= begin and s[0] <= end]))
        if (pid, BRANCH_LANE + tid) in lanes:
            rows_y.append((f"rank {pid} replica {tid} branch",
                           [s for s in lanes[(pid, BRANCH_LANE + tid)] if s[1] >= begin and s[0] <= end]))
        if (pid, tid) in reduce_spans:
            rows_y.append((f"rank {pid} replica {tid} reductions",
                           [(b, e, "reduce", "", {}) for b, e in reduce_spans[(pid, tid)] if e >= begin and b <= end]))
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(rows_y) + 1.2))
    for y, (label, spans) in enumerate(reversed(rows_y)):
        for s in spans:
            if s[2] in ("step", "evaluate", "checkpoint"):
                ax.broken_barh([((s[0] - begin) / 1e3, (s[1] - s[0]) / 1e3)], (y - 0.45, 0.9), facecolors="none",
                               edgecolors="#333333", linewidth=0.8)
            elif s[2] in colors:
                ax.broken_barh([((s[0] - begin) / 1e3, max((s[1] - s[0]) / 1e3, 1e-3))], (y - 0.35, 0.7),
                               facecolors=colors[s[2]], alpha=0.75 if s[2] == "reduce" else 1.0)
    ax.set_yticks(range(len(rows_y)))
    ax.set_yticklabels([label for label, _ in reversed(rows_y)])
    ax.set_xlabel("ms")
    ax.set_xlim(0, (end - begin) / 1e3)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
              loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(colors), frameon=False)
    ax.set_title(f"steps {chosen[0]}-{chosen[-1]} (outlined: a step)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="the trace files of a run (one per rank)")
    parser.add_argument("-o", "--output", help="write the merged trace to this file")
    parser.add_argument("--per-step", action="store_true", help="print every step, not only the median")
    parser.add_argument("--png", help="draw the timeline of a few steps into this PNG")
    parser.add_argument("--steps", type=int, default=3, help="steps to draw with --png (default 3)")
    args = parser.parse_args()
    events, metas = merge(args.traces)
    rows, lanes, reduce_spans = report(events, metas, args.per_step)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                json.dump({"displayTimeUnit": "ms", "traceEvents": events}, f)
        except OSError as e:
            fail(f"{args.output}: {e.strerror}")
        print(f"wrote {args.output}")
    if args.png:
        draw(args.png, rows, lanes, reduce_spans, max(1, args.steps))


if __name__ == "__main__":
    main()
