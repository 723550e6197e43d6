"""Share of a py-spy raw profile's samples per function (inclusive, and as the leaf), top 25 each.

`scheduler.raw` beside this file: `py-spy record -p <pid of sglang::scheduler> -d 60 -r 50 -f raw` taken
while `pytest tests/test_reliability_e2e.py -k memory_pressure_every` decoded 18 requests at once.

    python results/decode-attention/summarize_profile.py results/decode-attention/scheduler.raw
"""

import collections
import re
import sys

total = 0
inclusive: collections.Counter[str] = collections.Counter()
leaf: collections.Counter[str] = collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1)
    total += int(n)
    names = []
    for frame in stack.split(";"):
        m = re.match(r"(\S+) \((.*?):\d+\)", frame)
        if m:
            names.append(f"{m.group(1)} {m.group(2).split('/')[-1]}")
    for name in set(names):
        inclusive[name] += int(n)
    if names:
        leaf[names[-1]] += int(n)
print(f"{total} samples")
for title, counts in (("inclusive", inclusive), ("leaf", leaf)):
    print(f"--- {title}")
    for name, n in counts.most_common(25):
        print(f"{n / total:6.1%} {name}")
