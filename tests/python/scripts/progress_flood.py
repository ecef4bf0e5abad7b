"""A progress bar drawn with carriage returns as fast as Python can, among ordinary lines.

Writes $UPDATES updates `step NNNNNN\\r` (trailing carriage return, `print(..., end="\\r")`
style) to stdout, and 100 ordinary lines `line-NNN`: 50 before the bar, one every $UPDATES/4
updates, the rest after it. The last update before each ordinary line is the bar's state the log
must show."""
import os
import sys

updates = int(os.environ.get("UPDATES", "200000"))
out = sys.stdout
line = 0


def ordinary():
    global line
    out.write(f"line-{line:03d}\n")
    line += 1


for _ in range(50):
    ordinary()
every = max(1, updates // 4)
for i in range(updates):
    out.write(f"step {i:06d}\r")
    if i % every == every - 1 and line < 99:
        ordinary()
while line < 100:
    ordinary()
out.flush()
