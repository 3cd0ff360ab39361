"""The README's benchmark tables from `python -m pintail.bench` results.json files: per op,
each direction and shape with pintail, eager and torch.compile as fractions of the copy
bandwidth of their run, and the bar (the issue's, or the best anchor of BENCHMARKS.md where
that is higher); **bold** where pintail meets it. A later file overrides an earlier one for
the same (op, direction, N, provider) of the first file's shapes, so a partial re-run can
update a full one. Files given as NAME=PATH after --also add a column NAME with their
pintail fraction (other runs of the same code: the run-to-run spread).

    python scripts/readme_tables.py docs/bench-all-...json [docs/bench-....json ...] [--also run7=docs/....json ...]
"""

import json
import sys

SIZES = (1024, 4096, 8192, 32768, 131072, 262144)


def bar(op, direction, N):
    if op in ("softmax", "log_softmax"):
        if direction == "fwd":
            return 0.96 if N == 1024 else 0.94
        return 0.98 if N <= 32768 else 0.85
    if op == "rms_norm" and direction == "fwd":
        return dict(zip(SIZES, (0.96, 0.95, 0.98, 0.95, 0.90, 0.90)))[N]
    if op == "layer_norm" and direction == "fwd":
        return 0.96 if N == 1024 else 0.90
    if op == "rotary":
        return 0.95 if direction == "fwd" else 0.91
    if op == "cross_entropy":
        if direction == "fwd":
            return 0.90
        return {131072: 0.88, 262144: 0.86}.get(N, 0.85)
    return 0.90 if direction == "fwd" else 0.85


def main(argv):
    paths = argv[:argv.index("--also")] if "--also" in argv else argv
    also = [a.split("=", 1) for a in argv[len(paths) + 1:]]
    others = {name: {(r["op"], r["direction"], r["N"]): r["fraction_of_copy"]
                     for r in json.load(open(path))["results"] if r["provider"] == "pintail"}
              for name, path in also}
    rows = {}
    for i, path in enumerate(paths):
        for r in json.load(open(path))["results"]:
            key = (r["op"], r["direction"], r["N"])
            if i == 0 or key in rows:  # later files update the first file's shapes only
                rows.setdefault(key, {})[r["provider"]] = r
    ops = list(dict.fromkeys(k[0] for k in rows))
    for op in ops:
        keys = [k for k in rows if k[0] == op]
        checked = any("pintail_unchecked" in rows[k] for k in keys)
        first = "checked (default) | unchecked" if checked else "pintail"
        extra = "".join(f" pintail {name} |" for name in others)
        print(f"\n### {op}\n| dir | N | {first} |{extra} eager | compile | pintail ms | bar |")
        print("|---|---|---|---|---|---|---|" + ("---|" if checked else "") + "---|" * len(others))
        for k in keys:
            _, direction, N = k
            row, b = rows[k], bar(*k)

            def frac(p):
                if p not in row:
                    return "-"
                f = row[p]["fraction_of_copy"]
                return f"**{f:.2f}**" if p.startswith("pintail") and f >= b else f"{f:.2f}"
            cells = [frac("pintail")] + ([frac("pintail_unchecked")] if checked else [])
            cells += [f"{run[k]:.2f}" if k in run else "-" for run in others.values()]
            cells += [frac("eager"), frac("compile"), f"{row['pintail']['ms']:.3f}", f"{b:.2f}"]
            print(f"| {direction} | {N} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
