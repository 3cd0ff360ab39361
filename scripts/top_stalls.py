"""Where a kernel's warps wait, instruction by instruction: a summary of Nsight Compute's
source page (`ncu -i REPORT --page source --csv --print-source sass`, a report taken with
`--section SourceCounters`). Per kernel in the report: the SASS instructions with the most
warp-stall samples, and the samples summed by opcode. Columns are found by name, so a
different ncu version that renames them prints its header instead of a wrong table.

    python scripts/top_stalls.py source.csv [--top 30]
"""

import csv
import io
import sys
from collections import Counter


def tables(text):
    """(kernel name, rows as dicts) for each kernel's block of CSV in ncu's output: a
    "Kernel Name" line, then a header and one row per SASS instruction."""
    blocks, name, current = [], "?", []
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            if current:
                blocks.append((name, current))
            name, current = next(csv.reader([line]))[1], []
        elif line.startswith('"'):
            current.append(line)
    if current:
        blocks.append((name, current))
    return [(name, list(csv.DictReader(io.StringIO("\n".join(block))))) for name, block in blocks]


def column(header, *words):
    return next((h for h in header if all(w.lower() in h.lower() for w in words)), None)


def number(value):
    try:
        return float(str(value).replace(",", ""))
    except ValueError:
        return 0.0


def summarise(name, rows, top):
    if not rows:
        return
    header = list(rows[0])
    samples = column(header, "stall", "all samples") or column(header, "sampling", "all")
    not_issued = column(header, "not-issued") or column(header, "not issued")
    source = column(header, "source")
    if samples is None or source is None:
        print(f"== {name}: no stall-sampling column; header: {header}")
        return
    total = sum(number(r[samples]) for r in rows) or 1.0
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    print(f"== {name}: {len(rows)} instructions, {total:.0f} stall samples")
    if reasons:
        by_reason = Counter({h[6:]: sum(number(r[h]) for r in rows) for h in reasons})
        print("by reason: " + ", ".join(f"{k} {n / total:.1%}" for k, n in by_reason.most_common(8) if n))
    for r in sorted(rows, key=lambda r: -number(r[samples]))[:top]:
        extra = f" (not issued {number(r[not_issued]) / total:5.1%})" if not_issued else ""
        if reasons:
            main = max(reasons, key=lambda h: number(r[h]))
            extra += f" {main[6:]}" if number(r[main]) else ""
        print(f"{number(r[samples]) / total:6.1%}{extra}  {r[source].strip()}")
    by_op = Counter()
    for r in rows:
        words = r[source].split()
        op = next((w for w in words if not w.startswith("@")), "?").split(".")[0]
        by_op[op] += number(r[samples])
    print("by opcode: " + ", ".join(f"{op} {n / total:.1%}" for op, n in by_op.most_common(12)))


def main(argv):
    top = int(argv[argv.index("--top") + 1]) if "--top" in argv else 30
    with open(argv[0]) as f:
        text = f.read()
    found = tables(text)
    if not found:
        print("no CSV table found; the file starts:\n" + text[:2000])
    for name, rows in found:
        summarise(name, rows, top)


if __name__ == "__main__":
    main(sys.argv[1:])
