"""A real tqdm bar (stderr, redrawn on every iteration) between ordinary stderr lines:
5 lines `before-N`, $STEPS iterations, 5 lines `after-N`."""
import os
import sys

from tqdm import tqdm

steps = int(os.environ.get("STEPS", "50000"))
for i in range(5):
    print(f"before-{i}", file=sys.stderr)
for _ in tqdm(range(steps), mininterval=0, miniters=1, ncols=60):
    pass
for i in range(5):
    print(f"after-{i}", file=sys.stderr)
