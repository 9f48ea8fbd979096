"""Memory of the overlapping mode at the 0.5B shape (issue 33): where the async producer's copies live.

``ru_maxrss`` (what ``trl_comparison.py`` reports) counts a page in every process that maps it, so a weight copy
in shared memory, mapped by the trainer and by its rollout process, is counted twice, and the peaks of two
processes are added although they may come at different moments. This probe runs configurations of
``bench/trl_comparison.py`` one after the other (each a fresh process tree) and samples, every
``--every`` seconds, ``/proc/<pid>/smaps_rollup`` of every process in the tree: the peak RSS of each
process, and the peak of the tree's total PSS (proportional set size: a shared page is split between the
processes that map it, so the sum is the physical memory the run holds) at one moment.

    python bench/async_memory.py --only ours-hf-2t,ours-hf-async,trl-hf-2t

Writes ``bench/results/async_memory.{md,json}`` (``--results``). The weight copy of the 0.5B shape is
494.0M parameters x 4 bytes = 1.84 GiB in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 2**30


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _rollup(pid: int) -> dict[str, int] | None:
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    kb = {}
    for line in lines[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            kb[key] = int(parts[0]) * 1024
    return {"rss": kb.get("Rss", 0), "pss": kb.get("Pss", 0), "shared": kb.get("Shared_Clean", 0)
            + kb.get("Shared_Dirty", 0), "name": name, "cmd": cmd}


def _role(cmd: str) -> str:
    if "--child" in cmd:
        return "trainer"  # the configuration's process (trl_comparison's child)
    if "multiprocessing" in cmd or "spawn_main" in cmd:
        return "rollout process"
    return "harness" if "trl_comparison.py" in cmd else "other"


def measure(config: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(HERE / "trl_comparison.py"), "--workload", args.workload, "--only", config,
           "--rounds", "1", "--steps", str(args.steps), "--warmup", "1", "--max-new-tokens", str(args.max_new_tokens),
           "--results", f"/tmp/async_memory_{config}.json", "--timeout", str(args.timeout)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[str, dict[str, float]] = {}
    total_pss = 0.0
    total_rss = 0.0
    stop = threading.Event()

    def sample() -> None:
        nonlocal total_pss, total_rss
        while not stop.is_set():
            pss = rss = 0
            for pid in _tree(proc.pid):
                r = _rollup(pid)
                if r is None or pid == proc.pid:
                    continue
                role = _role(r["cmd"])
                pss += r["pss"]
                rss += r["rss"]
                p = peaks.setdefault(role, {"rss": 0.0, "pss": 0.0, "shared": 0.0})
                p["rss"] = max(p["rss"], r["rss"] / GIB)
                p["pss"] = max(p["pss"], r["pss"] / GIB)
                p["shared"] = max(p["shared"], r["shared"] / GIB)
            total_pss = max(total_pss, pss / GIB)
            total_rss = max(total_rss, rss / GIB)
            stop.wait(args.every)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, _ = proc.communicate()
    stop.set()
    thread.join()
    result = json.loads(Path(f"/tmp/async_memory_{config}.json").read_text()) if proc.returncode == 0 else {}
    runs = [r for r in result.get("runs", []) if r.get("config") == config]
    ok = bool(runs) and not runs[0].get("error")
    return {"config": config, "ok": ok, "returncode": proc.returncode, "peaks": peaks,
            "peak_total_pss_gb": total_pss, "peak_total_rss_gb": total_rss,
            "ru_maxrss_gb": runs[0].get("peak_rss_gb") if runs else None,
            "step_s": [s["seconds"] for s in runs[0]["steps"]] if ok else [], "tail": out[-2000:] if not ok else ""}


def report(results: list[dict], args: argparse.Namespace) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [
        "# Memory of sync, colocate_async and TRL at the 0.5B shape (issue 33)", "",
        f"`python bench/async_memory.py --only {args.only} --steps {args.steps}`; {os.cpu_count()} cores ({cpu}); "
        f"{time.strftime('%Y-%m-%d')}. Each configuration as `bench/trl_comparison.py` runs it (workload "
        f"`{args.workload}`, {args.max_new_tokens}-token responses), sampled every {args.every} s. A weight copy is "
        f"494.0M x 4 bytes = 1.84 GiB.", "",
        "PSS splits a page shared by several processes between them, so the total PSS is the memory the run holds; "
        "the RSS columns count shared pages in each process that maps them (`ru_maxrss`, what "
        "`trl_comparison.md` reports, adds the process's peak and its largest child's).", "",
        "| configuration | runs ok | peak total PSS (GiB) | trainer peak RSS (GiB) | rollout process peak RSS "
        "(GiB) | of it shared (GiB) | ru_maxrss self + children (GiB) |",
        "|---|---|---|---|---|---|---|"]
    for r in results:
        p = r["peaks"]
        tr, ro = p.get("trainer", {}), p.get("rollout process", {})
        f = (lambda v: f"{v:.2f}" if isinstance(v, float) and v else "-")
        lines.append(f"| {r['config']} | {'yes' if r['ok'] else 'no'} | {r['peak_total_pss_gb']:.2f} | "
                     f"{f(tr.get('rss'))} | {f(ro.get('rss'))} | {f(ro.get('shared'))} | {f(r['ru_maxrss_gb'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="ours-hf-2t,ours-hf-async,trl-hf-2t")
    ap.add_argument("--workload", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--results", default=str(HERE / "results" / "async_memory.json"))
    args = ap.parse_args()
    results = [measure(c, args) for c in args.only.split(",")]
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "tail"}), flush=True)
        if not r["ok"]:
            print(r["tail"], file=sys.stderr)
    Path(args.results).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    md = report(results, args)
    Path(args.results).with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
