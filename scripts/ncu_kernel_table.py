#!/usr/bin/env python3
"""Per-kernel totals of the last N kernels in an Nsight Compute raw CSV.

    ncu --csv --page raw --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
launch__grid_size,launch__block_size ... > run.csv
    scripts/ncu_kernel_table.py run.csv 485     # the last 485 kernels: one decode step

Prints each kernel's launches, total and mean device time, DRAM bytes read per launch and
the read rate, slowest first.
"""
import collections
import csv
import sys


def main(path, last):
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    header = rows[0]
    col = {name: i for i, name in enumerate(header)}
    data = [r for r in rows[2:] if len(r) == len(header)][-last:]
    number = lambda r, name: float(r[col[name]].replace(",", ""))
    kernels = collections.OrderedDict()
    for r in data:
        k = kernels.setdefault(r[col["Kernel Name"]], [0, 0.0, 0.0, r[col["launch__grid_size"]]])
        k[0] += 1
        k[1] += number(r, "gpu__time_duration.sum")
        k[2] += number(r, "dram__bytes_read.sum")
    print(f"{'kernel':40s} {'launches':>8s} {'total us':>10s} {'mean us':>8s} {'MB/launch':>10s} {'GB/s':>8s}  grid")
    total = 0.0
    for name, (n, ns, bytes_read) in sorted(((k, v[:3]) for k, v in kernels.items()), key=lambda kv: -kv[1][1]):
        total += ns
        print(f"{name:40s} {n:8d} {ns / 1e3:10.1f} {ns / n / 1e3:8.2f} {bytes_read / n / 1e6:10.2f} "
              f"{bytes_read / ns if ns else 0:8.1f}  {kernels[name][3]}")
    print(f"total {total / 1e6:.3f} ms over {len(data)} kernels")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
