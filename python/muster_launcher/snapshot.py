"""In-memory snapshots for training scripts (muster `--snapshot-every N`, docs/snapshots.md).

Every N optimizer steps each rank copies its training state into a memory file and hands the file
to its node's agent; a crashed rank loses only the steps since. On a restart within the job every
rank restores the newest step that every rank of the gang handed over:

    from muster_launcher import snapshot

    restored = snapshot.restore()              # None, or (step, state) on every rank alike
    if restored:
        step, state = restored
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
    for step in range(start, total):
        train_one_step()
        snapshot.save(step, lambda: {"model": model.state_dict(), "opt": opt.state_dict()})

`save(step, state)` does something only every N steps (`due(step)`; `state` may be a callable, so
that the state dict is built only then) and returns whether the agent holds the part. `step` is
the number of the step just finished; `restore()` gives it back, so training goes on at step + 1.

A state is what `torch.distributed.checkpoint` takes: nested dicts, lists and tuples of tensors
and plain Python values. Tensor bytes are copied into the memory file, never pickled; the rest is
pickled with the tensors left out. CUDA tensors are copied to the host and restored to the same
device. Outside muster, or without `--snapshot-every`, every call is a cheap no-op returning
False or None. Standard library only at import: torch is imported when a state is saved.

The socket (MUSTER_SNAPSHOT_SOCKET, a `SOCK_SEQPACKET` Unix socket) carries one message per
packet: "hello <local_rank> <rank> <pid> <attempt>", "hold <step> <bytes> <blocked_us>" with the
memory file,
"restore"; the agent answers "held <step>", "refused <step> <why>", "off <step> <why>",
"restore <step> <bytes>" with the memory file, or "none <why>".
"""

import io
import os
import pickle
import struct
import sys
import time

SOCKET_ENV = "MUSTER_SNAPSHOT_SOCKET"
EVERY_ENV = "MUSTER_SNAPSHOT_EVERY"

__all__ = ["every", "due", "save", "restore", "turn_off", "last_timing", "SnapshotError"]

# The memory file: magic, the pickled structure's length, the tensor table's length, then both,
# then the tensors' bytes from a 64-byte boundary.
_MAGIC = b"MUSTSNP1"
_HEADER = struct.Struct("<8sQQ")
_ALIGN = 64
_REPLY_WAIT_S = 300.0
_MAX_PACKET = 1024


class SnapshotError(Exception):
    """A state this helper cannot snapshot (the snapshot is skipped, training goes on)."""


def every():
    """N of `--snapshot-every N`; 0 when snapshots are off."""
    if not os.environ.get(SOCKET_ENV):
        return 0
    try:
        return max(0, int(os.environ.get(EVERY_ENV, "0")))
    except ValueError:
        return 0


def due(step):
    """Whether `save` takes a snapshot at `step`."""
    n = every()
    return n > 0 and step > 0 and step % n == 0 and not _link.off


def turn_off():
    """No more snapshots from this process (a state muster cannot take)."""
    _link.off = True


def last_timing():
    """Where the last snapshot's blocking time went, in seconds: `pickle_s` (the structure, the
    tensors left out), `copy_s` (the tensors' bytes into the memory file), `reply_s` (the round
    trip to the agent), and its size in `bytes`; empty before the first."""
    return dict(_last)


_last = {}


def save(step, state):
    """Hands this rank's `state` (or what the callable `state` returns) at `step` to the agent
    when a snapshot is due; returns True when the agent holds it."""
    if not due(step):
        return False
    started = time.perf_counter()
    if callable(state):
        state = state()
    try:
        memory, size = _write(state)
    except SnapshotError as e:
        _say("snapshot of step %d skipped: %s" % (step, e))
        return False
    except Exception as e:  # noqa: BLE001 - a snapshot never costs the job its training
        _link.off = True
        _say("snapshots are off for this process: step %d could not be copied (%s: %s)"
             % (step, type(e).__name__, e))
        return False
    sent = time.perf_counter()
    try:
        # The agent adds its own handling to the time the rank blocked before sending (in
        # microseconds) for muster_snapshot_blocking_seconds.
        words = _link.ask("hold %d %d %d" % (step, size, int((sent - started) * 1e6)), memory)
    finally:
        os.close(memory)
    _last["reply_s"] = time.perf_counter() - sent
    _last["bytes"] = size
    if words is None:
        return False
    if words[0] == "held":
        return True
    if words[0] == "off":
        _link.off = True
        _say("snapshots are off for this job: %s" % " ".join(words[2:]))
    return False


def restore():
    """The newest step every rank of the gang handed over, as `(step, state)`, or None."""
    if not every():
        return None
    reply = _link.ask_for_memory("restore")
    if reply is None:
        return None
    words, memory = reply
    if words[0] != "restore" or memory is None:
        return None
    try:
        step = int(words[1])
        return step, _read(memory)
    finally:
        os.close(memory)


# -- the memory file ---------------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    """Pickles the structure, leaving each tensor out as a reference into the table."""

    def __init__(self, file, torch):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.torch = torch
        self.tensors = []

    def persistent_id(self, obj):
        if not isinstance(obj, self.torch.Tensor):
            return None
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(obj, dtensor):
            # A shard of a sharded state (FSDP2, tensor parallelism, DCP's get_state_dict): its
            # local bytes, and where it sits, so that restore() gives the same DTensor back.
            mesh = obj.device_mesh
            self.tensors.append(obj.to_local())
            where = (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names,
                     tuple(obj.placements), tuple(obj.shape), tuple(obj.stride()),
                     bool(obj.requires_grad))
            return ("muster-dtensor", len(self.tensors) - 1, where)
        self.tensors.append(obj)
        return ("muster-tensor", len(self.tensors) - 1)


def _dtensor_type():
    """torch's DTensor, when this torch has it and the script's state may hold one."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors):
        super().__init__(file)
        self.tensors = tensors
        self.meshes = {}

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "muster-tensor":
            return self.tensors[pid[1]]
        if isinstance(pid, tuple) and len(pid) == 3 and pid[0] == "muster-dtensor":
            return self._dtensor(self.tensors[pid[1]], *pid[2])
        raise pickle.UnpicklingError("not a snapshot's tensor reference: %r" % (pid,))

    def _dtensor(self, local, device_type, ranks, dim_names, placements, shape, stride,
                 requires_grad):
        from torch.distributed.tensor import DTensor

        key = (device_type, repr(ranks), dim_names)
        if key not in self.meshes:
            self.meshes[key] = _mesh(device_type, ranks, dim_names)
        tensor = DTensor.from_local(local, self.meshes[key], placements, run_check=False,
                                    shape=shape, stride=stride)
        return tensor.requires_grad_(True) if requires_grad else tensor


def _mesh(device_type, ranks, dim_names):
    """The device mesh a shard was on: equal (by value) to the one the script builds."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if ranks == list(range(dist.get_world_size())):
        # The whole world on one dimension (FSDP's usual mesh): the default group, no new one.
        return DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=dim_names)
    # Every rank restores the same step, so every rank makes the same groups in the same order.
    return DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=dim_names)


def _aligned(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _write(state):
    """A sealable memory file holding `state`; returns (descriptor, size)."""
    import ctypes

    import torch

    started = time.perf_counter()
    structure = io.BytesIO()
    pickler = _Pickler(structure, torch)
    try:
        pickler.dump(state)
    except Exception as e:
        raise SnapshotError("its state cannot be pickled: %s" % e) from e
    table, sources, offset = [], [], 0
    for tensor in pickler.tensors:
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise SnapshotError("a %s tensor (only dense tensors are snapshotted)" % tensor.layout)
        source = tensor.detach()
        if source.device.type != "cpu":
            source = source.cpu()
        source = source.resolve_conj().resolve_neg().contiguous().reshape(-1)
        nbytes = source.numel() * source.element_size()
        table.append((str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape),
                      str(tensor.device), bool(tensor.requires_grad), offset, nbytes))
        sources.append(source)
        offset += _aligned(nbytes)
    table_bytes = pickle.dumps(table, protocol=pickle.HIGHEST_PROTOCOL)
    structure_bytes = structure.getvalue()
    data_start = _aligned(_HEADER.size + len(structure_bytes) + len(table_bytes))
    size = data_start + offset
    pickled = time.perf_counter()
    memory = os.memfd_create("muster-snapshot", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(memory, max(size, 1))
        head = _HEADER.pack(_MAGIC, len(structure_bytes), len(table_bytes))
        _write_all(memory, head + structure_bytes + table_bytes, 0)
        # The kernel's copy (pwrite) allocates and fills each page of the memory file in one
        # pass: twice as fast as a copy through a fresh mapping, where every page faults.
        for source, entry in zip(sources, table):
            if entry[5]:
                # The bytes in place (no numpy: the wheel does not require it); `source` keeps
                # them alive.
                view = (ctypes.c_char * entry[5]).from_address(source.data_ptr())
                _write_all(memory, view, data_start + entry[4])
    except BaseException:
        os.close(memory)
        raise
    _last["pickle_s"] = pickled - started
    _last["copy_s"] = time.perf_counter() - pickled
    return memory, max(size, 1)


def _write_all(memory, data, at):
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(memory, view, at)
        view, at = view[written:], at + written


def _read(memory):
    """The state in the memory file `memory`, its tensors copied out."""
    import torch

    head = os.pread(memory, _HEADER.size, 0)
    magic, structure_len, table_len = _HEADER.unpack(head)
    if magic != _MAGIC:
        raise SnapshotError("the agent handed back something that is no snapshot")
    body = os.pread(memory, structure_len + table_len, _HEADER.size)
    structure, table = body[:structure_len], pickle.loads(body[structure_len:])
    data_start = _aligned(_HEADER.size + structure_len + table_len)
    tensors = []
    for dtype_name, shape, device, requires_grad, offset, nbytes in table:
        dtype = getattr(torch, dtype_name)
        if nbytes:
            buffer = bytearray(nbytes)
            os.preadv(memory, [buffer], data_start + offset)
            tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
        else:
            tensor = torch.empty(shape, dtype=dtype)
        if device != "cpu":
            tensor = tensor.to(device)
        if requires_grad:
            tensor.requires_grad_(True)
        tensors.append(tensor)
    return _Unpickler(io.BytesIO(structure), tensors).load()


# -- the socket --------------------------------------------------------------------------------


def _say(message):
    try:
        print("muster: " + message, file=sys.stderr, flush=True)
    except Exception:
        pass


class _Link:
    """This process's connection to the agent (a forked child opens its own)."""

    def __init__(self):
        self.sock = None
        self.pid = None
        self.off = False

    def _connected(self):
        import socket

        if self.sock is not None and self.pid == os.getpid():
            return self.sock
        self.sock, self.pid = None, os.getpid()
        address = os.environ.get(SOCKET_ENV, "")
        if not address:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(_REPLY_WAIT_S)
            sock.connect("\0" + address[1:] if address.startswith("@") else address)
            sock.send(("hello %s %s %d %s" % (
                os.environ.get("LOCAL_RANK", "0"),
                os.environ.get("RANK", "0"),
                os.getpid(),
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            )).encode("ascii"))
        except OSError as e:
            sock.close()
            _say("snapshots: no agent at %s (%s)" % (address, e))
            self.off = True
            return None
        self.sock = sock
        return sock

    def ask(self, line, memory=None):
        """Sends `line` (with `memory`) and returns the answer's words, or None."""
        reply = self.ask_for_memory(line, memory)
        if reply is None:
            return None
        words, received = reply
        if received is not None:
            os.close(received)
        return words

    def ask_for_memory(self, line, memory=None):
        import socket

        sock = self._connected()
        if sock is None:
            return None
        try:
            if memory is None:
                sock.send(line.encode("ascii"))
            else:
                socket.send_fds(sock, [line.encode("ascii")], [memory])
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_PACKET, 1)
        except OSError as e:
            _say("snapshots: the agent's socket failed (%s); no more snapshots" % e)
            self.sock, self.off = None, True
            return None
        words = data.decode("ascii", "replace").split()
        if not words:
            self.sock, self.off = None, True
            for fd in fds:
                os.close(fd)
            return None
        return words, (fds[0] if fds else None)


_link = _Link()
