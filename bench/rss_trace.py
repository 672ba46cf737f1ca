"""Where a command's resident memory peaks: `python bench/rss_trace.py [--every 0.5] [--tsv
FILE] -- COMMAND ...` runs COMMAND, samples its resident set (VmRSS of /proc/PID/status) and
that of its process tree every --every seconds, and ties the samples to its output lines: each
line printed is followed by the largest RSS seen until the next line, so a peak is named by the
phase it falls in (compile, the step, the held-out evaluation, the write of --out).

Prints the command's output as it comes, each line prefixed with the seconds since the start
and the RSS at that moment (GiB), then a table of the phases (between two output lines) by peak
RSS, largest first, and the maximum VmHWM (the kernel's own peak of the process, what
`/usr/bin/time -v` reports as its maximum resident set). --tsv writes every sample (seconds,
RSS of the process, RSS of the tree, in kB) for plotting.

Linux only (/proc). The command's stderr is merged into its stdout, and a progress bar that
redraws without newlines shows as one line when it ends.
"""
import argparse
import os
import subprocess
import sys
import threading
import time

GIB = 1 << 20            # kB in a GiB


def status_kb(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def tree(pid):
    """pid and its descendants (from /proc/*/stat's parent ids)."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--tsv", help="write every sample here")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("give the command after --")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    phases = [["(start)", 0.0, 0, 0]]          # [line, seconds, peak RSS kB, peak tree kB]
    lock = threading.Lock()

    def read():
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n").split("\r")[-1]
            t = time.perf_counter() - t0
            rss = status_kb(proc.pid, "VmRSS")
            with lock:
                phases.append([line, t, rss, rss])
            print(f"[{t:8.1f} s {rss / GIB:6.2f} GiB] {line}", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples, hwm = [], 0
    while proc.poll() is None:
        rss = status_kb(proc.pid, "VmRSS")
        hwm = max(hwm, status_kb(proc.pid, "VmHWM"))
        total = sum(status_kb(q, "VmRSS") for q in tree(proc.pid))
        samples.append((time.perf_counter() - t0, rss, total))
        with lock:
            ph = phases[-1]
            ph[2], ph[3] = max(ph[2], rss), max(ph[3], total)
        time.sleep(a.every)
    reader.join(5)
    if a.tsv:
        with open(a.tsv, "w") as f:
            f.write("seconds\trss_kb\ttree_kb\n")
            f.writelines(f"{t:.2f}\t{r}\t{s}\n" for t, r, s in samples)
    print(f"\nexit {proc.returncode}; peak VmHWM {hwm / GIB:.2f} GiB ({hwm} kB); phases by peak "
          f"RSS (the phase after the line):")
    for line, t, rss, total in sorted(phases, key=lambda ph: -ph[2])[:12]:
        print(f"  {rss / GIB:6.2f} GiB (tree {total / GIB:6.2f})  from {t:8.1f} s  {line[:90]}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
