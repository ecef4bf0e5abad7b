"""A DNS server that answers every query NXDOMAIN: the cluster DNS of a test job.

Docker's embedded resolver answers container names and aliases itself and forwards every other
name to the servers given with `--dns`; pointing those at this server makes a missing pod's name
fail at once with NXDOMAIN, as CoreDNS does for a pod Kubernetes has not published yet, and keeps
every lookup on the job's own network.
"""

import signal
import socket
import sys

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # PID 1: no default action otherwise
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", 53))
print("nxdomain dns listening on :53", flush=True)
while True:
    query, peer = sock.recvfrom(4096)
    if len(query) < 12:
        continue
    # Header: same id; QR=1, same opcode and RD; RA=1; RCODE=3 (NXDOMAIN); the question echoed.
    flags = 0x8000 | (query[2] & 0x79) << 8 | 0x80 | 3
    qdcount = query[4:6]
    reply = query[:2] + flags.to_bytes(2, "big") + qdcount + b"\0\0\0\0\0\0"
    # The question section runs from byte 12 to the end of the first QNAME + 4 bytes.
    end = 12
    while end < len(query) and query[end] != 0:
        end += query[end] + 1
    reply += query[12 : end + 5]
    sock.sendto(reply, peer)
