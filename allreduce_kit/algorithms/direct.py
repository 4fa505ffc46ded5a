"""Single-copy transport between the ranks of one node: read a peer's buffer out of its memory,
or write into it.

Linux's ``process_vm_readv`` copies from another process's memory into ours in one pass
(``process_vm_writev`` the other way). It is
what MPICH itself does with a large message between two processes of one node (its "CMA"
path), there behind a rendezvous handshake and into whatever buffer the receive names. Called
here, from compiled code, an algorithm step can

- fold a peer's data into its own in pieces of ``PIECE_BYTES``, each read into a small
  buffer that is still in cache when the fold reads it; through messages a step lands whole in
  a scratch buffer that has left the cache by then;
- skip the handshake. Each rank publishes its buffer's address once per call, then the number
  of steps it has finished, in a small window the node shares. A reader waits until the peer
  has finished the step whose data it needs (acquire loads, yielding the core when ranks share
  cores); an algorithm never overwrites a range, in its own buffer or (``push``) in a peer's,
  while a rank may still read what was there.

Beside the address each rank publishes its buffer's length and dtype and the algorithm
(``signature.word``). A rank compares a peer's word with its own when it first needs that
peer, before it reads from or writes into the peer's buffer (``reach``), not all peers' at the
start: that would make every call wait for every rank, where ``ring`` and ``rabenseifner`` wait
only for the few they talk to. A rank that finds a word other than its own voids the call: it
raises its counter to ``POISON``, above every step of the call, and returns. Every wait on it
then ends, and the waiter, seeing ``POISON``, voids the call too and returns without touching a
peer. The void reaches every rank. If the words differ, some rank reads a peer whose word
differs from its own (every rank reads from some peer, and the reads connect all ranks), and
each algorithm reads each such peer, or is read by it, before its reduce-scatter is done
(``ring``: the left neighbour from the first step; ``rabenseifner``: the partners, both ways,
and the rank that sits out is read at the start; ``two_shot``: every peer at the start). No
rank finishes before every rank's reduce-scatter is done, since every result holds every
segment, finished at its owner's last reduce-scatter step: so every rank meets the void on its
way, and raises the same ``ValueError`` (``signature.mismatch``). The cost on a well-formed call
is a store in ``begin`` and a load per peer read.

Available when every rank of the communicator is on one node and each can read the others'
memory, which is checked once per communicator, collectively: each rank reads a random token
from every other and compares it with the token sent by message, and writes one into every
other, which checks it. Separate PID namespaces,
seccomp filters and Yama ptrace restrictions fail here, and then the algorithms keep to
messages; ``ALLREDUCE_KIT_DIRECT=0`` makes them keep to messages anyway.

State passed to the compiled helpers (``Peers.state``): this rank, the rank count, the window's
address, the window's ``wait`` (``spin.py``; 0: spin), ``process_vm_readv``'s address,
the number of the current call (advanced by ``begin``), ``process_vm_writev``'s address, and
this rank's ``signature.word`` for the current call.
Window layout, per rank: a cache line holding its counter, then one holding its pid, its
buffer's address and its ``signature.word``.

Why ``ring``, ``rabenseifner`` and ``two_shot`` each write their schedule twice (here and by
messages): each direct loop is one compiled function that runs every
step, waits on its peers' counters and folds read pieces without returning to Python, because
``process_vm_readv`` and the counter waits can be called from compiled code but mpi4py's
messages cannot. Driving the same steps from Python through a common transport would add a
Python round trip per step and per piece, which at mid sizes is a large share of the call.
The two forms take the same steps and folds in the same order, and a test checks that they
give bitwise the same result (``tests/mpi/test_allreduce.py``).
"""
import ctypes
import os
from typing import Dict, Optional

import numpy as np
from llvmlite import ir
from mpi4py import MPI
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import config
from ..kernels import reduce as _loops
from .signature import mismatch, word
from .spin import NodeWindow, load_acquire, node_of, raise_flag, store_release, wait_on

#: Set to ``0`` to keep ``ring``, ``rabenseifner`` and ``two_shot`` to messages even where direct reads work.
ENV = config.DIRECT.name
#: Bytes read per piece when folding a peer's range in: a quarter of this machine's 1 MiB L2,
#: so that the piece and the range it folds into both stay in cache (docs/performance.md).
PIECE_BYTES = 256 << 10
#: Each rank's progress counter, and its pid, buffer address and signature, have a cache line each.
_LINE = 64
#: Steps a call may count: the counters of call g run from g << _STEP_BITS upward.
_STEP_BITS = 24
#: A counter at ``(g << _STEP_BITS) | POISON`` says call g is void: some rank found that the
#: ranks' buffers differ. It is above every step of call g, so every wait on it ends.
POISON = (1 << _STEP_BITS) - 1
#: What the compiled loops return when the ranks' buffers differ (``run`` raises).
MISMATCH = -2


@intrinsic
def _process_vm_call(typingctx, function, pid, local, remote):
    """``process_vm_readv`` or ``process_vm_writev`` ``(pid, local, 1, remote, 1, 0)`` through its
    address ``function``; ``local`` and ``remote`` are addresses of one ``struct iovec`` each."""
    sig = types.int64(function, pid, local, remote)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(i64, [ir.IntType(32), i64, i64, i64, i64, i64])
        one, zero = ir.Constant(i64, 1), ir.Constant(i64, 0)
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(fn, [builder.trunc(args[1], ir.IntType(32)), args[2], one, args[3], one, zero])

    return sig, codegen


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """Copy ``nbytes`` bytes from address ``src`` to address ``dst`` (this process's memory)."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], i8p), builder.inttoptr(args[1], i8p), args[2], 1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def begin(state, buf, algorithm):
    """Start a call: publish ``buf``'s address and ``signature.word(buf, algorithm)``, then the
    call's first counter value, which it returns. Waits for nobody: each peer's word is checked
    when this rank first needs that peer (``reach``, ``wait_all``)."""
    return begin_word(state, buf, word(buf, algorithm))


@njit(cache=True, nogil=True)
def begin_word(state, buf, signed):
    """``begin`` with the word to publish given (``signature.keyed_word``: for a collective whose
    call has more that must agree than ``buf``'s length and dtype, such as a root)."""
    rank, base = state[0], state[2]
    state[5] += 1
    first = state[5] << _STEP_BITS
    state[7] = signed
    store_release(base + _LINE * (2 * rank + 1) + 8, buf.ctypes.data)
    store_release(base + _LINE * (2 * rank + 1) + 16, state[7])
    raise_flag(base + _LINE * 2 * rank, first, state[3])
    return first


@njit(cache=True, nogil=True)
def _poison(state):
    """Publish that this call is void (``POISON`` in this rank's counter); returns ``MISMATCH``."""
    raise_flag(state[2] + _LINE * 2 * state[0], (state[5] << _STEP_BITS) | POISON, state[3])
    return MISMATCH


@njit(cache=True, nogil=True)
def finish(state, step):
    """Tell the others this rank has finished ``step`` (a counter value of the current call)."""
    raise_flag(state[2] + _LINE * 2 * state[0], step, state[3])


@njit(cache=True, nogil=True)
def wait_for(state, peer, step):
    """Until rank ``peer`` has finished ``step``: 0, or ``MISMATCH`` if ``peer`` has voided the
    call instead (this rank then voids it too, and must return without touching a peer)."""
    seen = wait_on(state[2] + _LINE * 2 * peer, step, state[3])
    if seen == (state[5] << _STEP_BITS) | POISON:
        return _poison(state)
    return 0


@njit(cache=True, nogil=True)
def reach(state, peer, step):
    """``wait_for(state, peer, step)``, then the buffer address ``peer`` published for this call,
    once its signature word is found equal to this rank's; ``MISMATCH`` (negative) if it differs
    or ``peer`` voided the call (this rank then voids it too).

    Call it only before reading from or writing into ``peer``'s buffer: ``peer`` cannot then have
    left the call, so the word read is this call's (a peer returns only once every rank that
    reads or writes its buffer has finished)."""
    if wait_for(state, peer, step) != 0:
        return MISMATCH
    line = state[2] + _LINE * (2 * peer + 1)
    if load_acquire(line + 16) != state[7]:
        return _poison(state)
    return load_acquire(line + 8)


@njit(cache=True, nogil=True)
def wait_all(state, first):
    """``reach`` every peer at ``first``, for algorithms that read or write every peer's buffer
    from the start: 0, or ``MISMATCH``."""
    rank, size = state[0], state[1]
    for k in range(1, size):
        if reach(state, (rank + k) % size, first) < 0:
            return MISMATCH
    return 0


@njit(cache=True, nogil=True)
def address_of(state, peer):
    """The buffer address ``peer`` published for this call, unchecked (``reach`` it first)."""
    return load_acquire(state[2] + _LINE * (2 * peer + 1) + 8)


@njit(cache=True, nogil=True)
def _transfer(function, state, peer, local, address, iov):
    pid = load_acquire(state[2] + _LINE * (2 * peer + 1))
    nbytes = local.size * local.itemsize
    done = 0
    while done < nbytes:
        iov[0], iov[1] = local.ctypes.data + done, nbytes - done
        iov[2], iov[3] = address + done, nbytes - done
        got = _process_vm_call(function, pid, iov.ctypes.data, iov.ctypes.data + 16)
        if got <= 0:
            return -1
        done += got
    return 0


@njit(cache=True, nogil=True)
def pull(state, peer, dst, address, iov):
    """Copy ``dst.size`` elements from ``address`` in ``peer``'s memory into ``dst``; 0, or -1 if
    the read failed. ``iov``: 4 int64 of room for the two ``iovec``."""
    return _transfer(state[4], state, peer, dst, address, iov)


@njit(cache=True, nogil=True)
def push(state, peer, src, address, iov):
    """Copy ``src`` to ``address`` in ``peer``'s memory; 0, or -1 if the write failed."""
    return _transfer(state[6], state, peer, src, address, iov)


@njit(cache=True, nogil=True)
def pull_parts(state, peer, dst, start, offsets, addresses, iov):
    """Copy elements ``start .. start + dst.size`` of a buffer held in parts into ``dst``: part j
    is elements ``offsets[j] .. offsets[j + 1]``, at ``addresses[j]`` in ``peer``'s memory (in
    this process's, by a plain copy, when ``peer`` is this rank). 0, or -1 if a read failed."""
    size, isz = dst.size, dst.itemsize
    j = np.searchsorted(offsets, start, side="right") - 1
    done = 0
    while done < size:
        at = start + done
        take = min(size - done, offsets[j + 1] - at)
        address = addresses[j] + (at - offsets[j]) * isz
        if peer == state[0]:
            _memcpy(dst[done:].ctypes.data, address, take * isz)
        elif pull(state, peer, dst[done:done + take], address, iov) != 0:
            return -1
        done += take
        j += 1
    return 0


@njit(cache=True, nogil=True)
def pull_combine(state, peer, mine, address, piece, iov, code):
    """``mine = mine op theirs``, where ``theirs`` is ``mine.size`` elements at ``address`` in
    ``peer``'s memory, read in pieces the size of ``piece`` (``code``: ``kernels.OP_CODES``)."""
    n, per = mine.size, piece.size
    start = 0
    while start < n:
        stop = min(start + per, n)
        if pull(state, peer, piece[:stop - start], address + start * mine.itemsize, iov) != 0:
            return -1
        _loops.combine(mine[start:stop], piece[:stop - start], code)
        start = stop
    return 0


@njit(cache=True, nogil=True)
def fold_from_peers(state, mine, offset, piece, iov, code):
    """``mine = mine op theirs`` for every peer in the order rank+1, rank+2, ... (mod p), where
    ``theirs`` is ``mine.size`` elements at byte ``offset`` of the buffer the peer published,
    read into ``piece`` (at least ``mine.size`` long, so ``mine`` stays in cache); 0, or -1 if a
    read failed. The reduce-scatter of ``two_shot`` and ``reduce_scatter``'s ``pairwise``, a piece
    at a time; ``reach`` every peer first."""
    rank, size = state[0], state[1]
    theirs = piece[:mine.size]
    for k in range(1, size):
        peer = (rank + k) % size
        if pull(state, peer, theirs, address_of(state, peer) + offset, iov) != 0:
            return -1
        _loops.combine(mine, theirs, code)
    return 0


@njit(cache=True, nogil=True)
def push_to_peers(state, mine, offset, iov):
    """Write ``mine`` at byte ``offset`` of every peer's published buffer, in the order rank+1,
    rank+2, ... (mod p); 0, or -1 if a write failed. The allgather of ``two_shot`` and
    ``allgather``'s ``pairwise``; ``reach`` every peer first."""
    rank, size = state[0], state[1]
    for k in range(1, size):
        peer = (rank + k) % size
        if push(state, peer, mine, address_of(state, peer) + offset, iov) != 0:
            return -1
    return 0


@njit(cache=True, nogil=True)
def leave(state, first):
    """Finish step ``first + 1`` and wait until every peer has too (no peer reads from or writes
    into this rank's buffer any more); 0, or ``MISMATCH``."""
    rank, size = state[0], state[1]
    finish(state, first + 1)
    for k in range(1, size):
        if wait_for(state, (rank + k) % size, first + 1) != 0:
            return MISMATCH
    return 0


def _libc_address(name: str) -> int:
    try:
        return ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


class Peers(NodeWindow):
    """One communicator's window of counters and addresses, and this rank's read buffers."""

    def __init__(self, node: MPI.Intracomm, oversubscribed: bool, readv: int, writev: int):
        size, rank = node.Get_size(), node.Get_rank()
        super().__init__(node, 2 * _LINE * size, oversubscribed)
        words = self.memory.view(np.int64)
        words[2 * rank * _LINE // 8:(2 * rank + 1) * _LINE // 8] = 0  # counter, sleeper count
        words[(2 * rank + 1) * _LINE // 8] = os.getpid()
        self.state = np.array([rank, size, self.memory.ctypes.data, self.wait, readv, 0, writev, 0], np.int64)
        self.iov = np.zeros(4, np.int64)
        self._piece = np.empty(PIECE_BYTES, np.uint8)
        self._pieces: Dict[np.dtype, np.ndarray] = {}
        node.Barrier()  # every counter is 0 before any rank raises its own

    def piece(self, dtype: np.dtype) -> np.ndarray:
        """The buffer ``pull_combine`` reads into, viewed as ``dtype``."""
        view = self._pieces.get(dtype)
        if view is None:
            view = self._pieces[dtype] = self._piece.view(dtype)
        return view

    def readable(self) -> bool:
        """Whether this rank reads every other rank's token correctly, and every other rank
        wrote its token into this one's memory correctly. Collective over the node."""
        size = self.node.Get_size()
        token = np.random.default_rng().integers(1, 2 ** 62, size=1, dtype=np.int64)
        inbox = np.zeros(size, np.int64)  # slot q: where rank q writes its token
        seen = self.node.allgather((int(token[0]), token.ctypes.data, inbox.ctypes.data))
        got = np.zeros(1, np.int64)
        ok = True
        for peer, (expected, address, theirs) in enumerate(seen):
            got[0] = 0
            ok &= pull(self.state, peer, got, address, self.iov) == 0 and got[0] == expected
            ok &= push(self.state, peer, token, theirs + 8 * self.node.Get_rank(), self.iov) == 0
        self.node.Barrier()  # every token is read and written before any is checked or freed
        ok &= all(int(inbox[peer]) == expected for peer, (expected, _, _) in enumerate(seen))
        return bool(ok)


def peers_for(comm) -> Optional[Peers]:
    """``comm``'s ``Peers``, made on the first call, or ``None`` where direct reads cannot be used.
    Collective over ``comm`` on the first call; a dictionary lookup after."""
    peers = comm.state.get(Peers, False)
    if peers is False:
        peers = comm.attach(Peers, _connect)
    return peers


def run(loop, comm, buf: np.ndarray, op, bounds: np.ndarray, name: str) -> bool:
    """Run an algorithm's compiled ``loop(buf, bounds, state, piece, iov, code, divisor)`` (0; -1
    if a transfer failed; -2 if ``begin`` found the ranks' buffers differ) with direct transfers;
    ``False`` where ``comm`` has none, or ``op`` has no compiled kernel, and the algorithm must
    send messages instead."""
    peers = peers_for(comm)
    if peers is None or op.code is None:
        return False
    done = loop(buf, bounds, peers.state, peers.piece(buf.dtype), peers.iov, op.code, op.divisor)
    if done == MISMATCH:
        raise mismatch(comm, buf, name)
    if done != 0:
        raise RuntimeError(f"allreduce(algorithm={name!r}): reading or writing a peer's buffer "
                           f"(process_vm_readv/writev) failed on rank {comm.myrank}; set {ENV}=0 to use messages")
    return True


def _connect(comm) -> Optional[Peers]:
    wanted = config.read(config.DIRECT)
    readv, writev = (_libc_address("process_vm_readv"), _libc_address("process_vm_writev")) if wanted else (0, 0)
    node = node_of(comm)
    if not comm.allreduce(readv != 0 and writev != 0 and node is not None, op=MPI.LAND):
        if node is not None:
            node.Free()
        return None
    peers = Peers(node, comm.oversubscribed, readv, writev)
    if not comm.allreduce(peers.readable(), op=MPI.LAND):
        peers.free()
        return None
    return peers
