"""Writes $LINES lines of $WIDTH bytes each to stdout and one line to stderr, as fast as it can,
in small unaligned chunks so that lines cross write boundaries; ends without a final newline."""
import os

rank = os.environ["RANK"]
lines = int(os.environ.get("LINES", "200"))
width = int(os.environ.get("WIDTH", "3000"))
buf = b"".join(f"r{rank}-{i:05d}-".encode().ljust(width, rank.encode()) + b"\n"
               for i in range(lines))
for i in range(0, len(buf), 777):
    os.write(1, buf[i:i + 777])
os.write(2, f"stderr of {rank}\n".encode())
os.write(1, f"tail-{rank}".encode())
