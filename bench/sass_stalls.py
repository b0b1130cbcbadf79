"""Summarise ncu's SASS source page (``bench/sass_profile.sh``'s sass.csv).

    python3 bench/sass_stalls.py sass.csv [--top 40]

Prints the total warp-stall samples and executed instructions, the samples per opcode, and the
``--top`` instructions by samples, each with its address, opcode line and share.
"""
from __future__ import annotations

import argparse
import collections
import csv


def read_rows(path: str) -> list[dict]:
    """The instruction rows of the CSV (the first line names the kernel)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(lines[start:]))


def number(text: str) -> float:
    return float(text.replace(",", "") or 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    rows = read_rows(args.csv)
    samples = [number(r["Warp Stall Sampling (All Samples)"]) for r in rows]
    executed = [number(r["Instructions Executed"]) for r in rows]
    total = sum(samples)
    print(f"{len(rows)} instructions, {total:.0f} stall samples, "
          f"{sum(executed):.0f} warp instructions executed")
    by_op = collections.Counter()
    for r, s in zip(rows, samples):
        by_op[r["Source"].split()[0].split(".")[0] if r["Source"].strip() else "?"] += s
    print("samples by opcode:", ", ".join(f"{op} {100 * s / total:.1f}%"
                                          for op, s in by_op.most_common(15)))
    order = sorted(range(len(rows)), key=lambda i: -samples[i])[:args.top]
    for i in sorted(order):
        print(f"{rows[i]['Address']:>6} {100 * samples[i] / total:5.1f}%  exec {executed[i]:8.0f}  "
              f"{rows[i]['Source'].strip()[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
