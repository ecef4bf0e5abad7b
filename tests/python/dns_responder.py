"""A tiny authoritative DNS responder for tests, on a loopback address: it answers A queries for
one name with one address, but only `delay` seconds after it started (NXDOMAIN before, like a
headless Service record Kubernetes has not published yet); `delay=None` never answers it. With
`gate`, a callable, the name is answered only while `gate()` is true (a Service without
`publishNotReadyAddresses`: the record exists while the pod is Ready).
AAAA queries for the name get an empty NOERROR once the A record exists. Anything else is
NXDOMAIN. Enough of RFC 1035 for a stub resolver; no recursion, no EDNS."""

import socket
import struct
import threading
import time


def _qname(packet, offset):
    labels = []
    while True:
        length = packet[offset]
        offset += 1
        if length == 0:
            return ".".join(labels).lower(), offset
        labels.append(packet[offset:offset + length].decode("ascii", "replace"))
        offset += length


class DelayedDns:
    def __init__(self, host, name, address, delay, gate=None):
        self.name = name.rstrip(".").lower()
        self.address = socket.inet_aton(address)
        self.delay = delay
        self.gate = gate
        self.answered = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 53))
        self.sock.settimeout(0.2)
        self.queries = []
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _published(self):
        if self.gate is not None:
            try:
                return bool(self.gate())
            except Exception:  # the gate is a probe: a failed probe means "not published"
                return False
        return self.delay is not None and time.monotonic() - self._started >= self.delay

    def _serve(self):
        while not self._stop.is_set():
            try:
                packet, peer = self.sock.recvfrom(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                reply = self._answer(packet)
            except (IndexError, struct.error):
                continue
            self.sock.sendto(reply, peer)

    def _answer(self, packet):
        qid, flags = struct.unpack("!HH", packet[:4])
        name, end = _qname(packet, 12)
        qtype, _qclass = struct.unpack("!HH", packet[end:end + 4])
        question = packet[12:end + 4]
        self.queries.append((name, qtype))
        rd = flags & 0x0100
        answers = b""
        count = 0
        if name == self.name and self._published():
            rcode = 0
            if qtype == 1:  # A
                answers = struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4) + self.address
                count = 1
                self.answered += 1
        else:
            rcode = 3  # NXDOMAIN
        header = struct.pack("!HHHHHH", qid, 0x8000 | 0x0400 | rd | rcode, 1, count, 0, 0)
        return header + question + answers

    def stop(self):
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=2)
