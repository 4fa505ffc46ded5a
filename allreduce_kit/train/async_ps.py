"""Asynchronous SGD through a parameter server, on MPI point-to-point: ``--mode async-ps``.

Ranks ``0..K-1`` are parameter servers, each holding one contiguous shard of the flat parameter
buffer (``shard_bounds``) and the SGD momentum for it; the other ranks are workers. A worker
loops: **pull** (ask server 0 for a grant of samples and its shard, then every other server for
its shard), **compute** the gradient of its next batch, **push** each shard of the gradient to
its server with ``Isend``, and go on at once. A server applies each gradient as it arrives
(the same SGD with momentum and weight decay as the synchronous trainer) unless
``max_staleness`` is set and the gradient is older than that many updates, in which case it
is rejected and counted.

The protocol, all on a ``Dup`` of the caller's communicator with the tags below, numpy buffers
only (no pickles):

- ``PULL`` (worker -> server, int64[1]) is answered by ``REPLY`` (int64[2]: the shard's version,
  i.e. updates applied to it so far, and the number of samples granted) and, if the grant is not
  zero, ``PARAMS`` (the shard). Server 0 hands out the sample budget (``epochs`` passes over the
  training set, or ``max_steps`` gradients) batch by batch; a grant of 0 tells the worker to stop.
- ``PUSH`` (float64[4]: the version pulled, samples, loss sum, correct) then ``GRAD`` (the shard
  of the gradient). Staleness = the shard's version now - the version pulled.
- ``BYE`` (worker -> servers 1..K-1 after server 0's stop; server 0 -> the others at the end),
  ``FINAL`` (servers 1..K-1 -> server 0: their staleness log, shard and momentum).
- ``FAILED`` (worker -> server 0, the error text as bytes) and ``ACK``: a worker that raises
  tells server 0, which reports which worker and when, and aborts the job.

Clean shutdown: a worker's push to a server precedes its next pull from that server, and MPI
keeps one sender's messages in order, so when server 0 has told every worker to stop it has
received every gradient it granted; every server finishes only when each worker has said
goodbye to it. At the end every rank checks (``Iprobe``) that no message is left unreceived.
A worker that stops talking for ``worker_timeout`` seconds is named by the server, which aborts
the job rather than wait forever.
"""
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, NoReturn, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..abort import abort_job, end_job, flush_for_launcher
from ..cli import plural
from . import checkpoint, data
from .model import MLP
from .optimizer import SGD
from .staleness import StalenessLog, distribution, per_worker
from .summary import build_summary, epoch_record
from .timing import pause
from .trainer import Config, digest, load_data

TAG_PULL, TAG_REPLY, TAG_PARAMS, TAG_PUSH, TAG_GRAD, TAG_BYE, TAG_FINAL, TAG_FAILED, TAG_ACK = range(7100, 7109)
POLL_SECONDS = 1e-4        # a server with nothing to receive sleeps this long, leaving the core to workers


@dataclass
class Options:
    """What only the asynchronous mode has (the CLI's ``--servers`` ... options)."""
    servers: int = 1
    max_staleness: Optional[int] = None      # None: apply every gradient however stale
    worker_timeout: float = 60.0             # seconds of silence after which a worker is presumed dead
    fault: Optional[Tuple[int, int, str]] = None   # (rank, after N gradients, "crash" | "hang"), for tests

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def shard_bounds(size: int, servers: int) -> List[Tuple[int, int]]:
    """``[start, stop)`` of each server's shard of a flat buffer of ``size`` elements."""
    return [(i * size // servers, (i + 1) * size // servers) for i in range(servers)]


class _Setup:
    """What servers and workers both know: the layout, the model (at rank 0's initial values), the data."""

    def __init__(self, config: Config, options: Options, comm: MPI.Intracomm, dataset: Optional[data.Dataset]):
        self.options = options
        self.comm = comm
        self.rank, self.ranks = comm.Get_rank(), comm.Get_size()
        self.servers = options.servers
        self.workers = list(range(self.servers, self.ranks))
        self.data = dataset if dataset is not None else load_data(config)
        # A gradient takes at most a worker's shard: a larger batch would repeat samples in it.
        self.config = replace(config, batch_size=data.shard_batch(len(self.data.y_train), max(len(self.workers), 1),
                                                                  config.batch_size))
        self.model = MLP(self.data.features, config.hidden, self.data.classes, dtype=config.dtype)
        # Every rank draws rank 0's initial values itself: the synchronous trainer's starting point.
        self.model.init(np.random.default_rng([config.seed, 4, 0]))
        self.bounds = shard_bounds(self.model.size, self.servers)
        self.epoch_samples = (len(self.data.y_train) // len(self.workers)) * len(self.workers)

    def warm_up(self) -> None:
        """Load the compiled SGD update and run one forward/backward, so neither lands in epoch 1."""
        SGD(1, self.model.dtype).warm_up()
        batch = np.arange(min(self.config.batch_size, len(self.data.y_train)))
        self.model.forward_backward(self.data.X_train[batch], self.data.y_train[batch])

    def shard(self, buf: np.ndarray, server: int) -> np.ndarray:
        lo, hi = self.bounds[server]
        return buf[lo:hi]


class ParameterServer:
    """Rank ``s < K``: owns shard s, applies gradients as they arrive; rank 0 also runs the budget."""

    def __init__(self, setup: _Setup, on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None):
        self.s = setup
        self.on_epoch = on_epoch
        self.comm, self.rank = setup.comm, setup.rank
        cfg = setup.config
        self.params = setup.shard(setup.model.params, self.rank)
        self.grad = np.zeros_like(self.params)
        self.optimizer = SGD(self.params.size, setup.model.dtype, cfg.momentum, cfg.weight_decay)
        self.version = 0
        self.log = StalenessLog()
        self.pushes = {w: 0 for w in setup.workers}
        self.heard = {}
        self.done_workers: set = set()          # server 0: told to stop; others: said goodbye
        self.bye_from_root = self.rank == 0
        self._int1 = np.zeros(1, dtype=np.int64)
        self._reply = np.zeros(2, dtype=np.int64)
        self._push = np.zeros(4, dtype=np.float64)
        # Server 0's budget and per-epoch accounting.
        self.budget = cfg.epochs * setup.epoch_samples
        self.max_updates = cfg.max_steps if cfg.max_steps > 0 else None
        self.granted_samples = self.granted_updates = 0
        self.received = 0
        self.epoch = 0
        self.epoch_sums = np.zeros(3)              # loss sum, correct, samples
        self.epoch_updates = 0
        self.history: List[Dict[str, Any]] = []
        self.start = self.epoch_start = time.perf_counter()

    # -- the loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        status = MPI.Status()
        self.start = self.epoch_start = time.perf_counter()
        self.heard = {w: self.start for w in self.s.workers}
        last_check = self.start
        while len(self.done_workers) < len(self.s.workers) or not self.bye_from_root:
            if not self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                now = time.perf_counter()
                if now - last_check > 0.05:
                    self._check_silence(now)
                    last_check = now
                time.sleep(POLL_SECONDS)
                continue
            src, tag = status.Get_source(), status.Get_tag()
            self.heard[src] = time.perf_counter()
            if tag == TAG_PULL:
                self._on_pull(src)
            elif tag == TAG_PUSH:
                self._on_push(src)
            elif tag == TAG_BYE:
                self.comm.Recv(self._int1, source=src, tag=TAG_BYE)
                if src >= self.s.servers:
                    self.done_workers.add(src)
                else:
                    self.bye_from_root = True
            elif tag == TAG_FAILED:
                self._on_failed(src, status.Get_count(MPI.BYTE))
            else:
                raise RuntimeError(f"parameter server rank {self.rank}: unexpected message tag {tag} from rank {src}")
        if self.rank == 0:
            self._close_epoch()
        else:
            self._send_final()

    def _on_pull(self, src: int) -> None:
        self.comm.Recv(self._int1, source=src, tag=TAG_PULL)
        grant = 1
        if self.rank == 0 and src >= self.s.servers:
            grant = self._grant()
            if grant == 0:
                self.done_workers.add(src)
        self._reply[:] = (self.version, grant)
        self.comm.Send(self._reply, dest=src, tag=TAG_REPLY)
        if grant:
            self.comm.Send(self.params, dest=src, tag=TAG_PARAMS)

    def _grant(self) -> int:
        """Server 0: samples for the next gradient (0 once the budget is spent)."""
        if self.max_updates is not None and self.granted_updates >= self.max_updates:
            return 0
        # Never across an epoch's end: with one worker the batches are then exactly the synchronous trainer's.
        epoch_end = (self.granted_samples // self.s.epoch_samples + 1) * self.s.epoch_samples
        grant = min(self.s.config.batch_size, self.budget - self.granted_samples, epoch_end - self.granted_samples)
        if grant > 0:
            self.granted_samples += grant
            self.granted_updates += 1
        return max(grant, 0)

    def _on_push(self, src: int) -> None:
        self.comm.Recv(self._push, source=src, tag=TAG_PUSH)
        self.comm.Recv(self.grad, source=src, tag=TAG_GRAD)
        pulled, samples, loss_sum, correct = self._push
        staleness = self.version - int(pulled)
        bound = self.s.options.max_staleness
        applied = bound is None or staleness <= bound
        if applied:
            self.optimizer.step(self.params, self.grad, self.s.config.lr)
            self.version += 1
        self.log.record(src, staleness, applied)
        self.pushes[src] += 1
        if self.rank == 0:
            self.received += int(samples)
            self.epoch_sums += (loss_sum, correct, samples)
            self.epoch_updates += int(applied)
            if self.received >= (self.epoch + 1) * self.s.epoch_samples:
                self._close_epoch()

    def _close_epoch(self) -> None:
        """Server 0: record the epoch's loss and accuracies (test accuracy on the full parameters)."""
        if self.epoch_sums[2] == 0:
            return
        now = time.perf_counter()
        self._gather_params()
        X, y = self.s.data.X_test, self.s.data.y_test
        test_correct = self.s.model.evaluate(X, y)
        self.history.append(epoch_record(self.epoch, self.epoch_updates, *self.epoch_sums, test_correct, len(y),
                                         now - self.epoch_start, self.s.config.lr))
        if self.on_epoch:
            self.on_epoch(self.history[-1])
        self.epoch += 1
        self.epoch_sums[:] = 0
        self.epoch_updates = 0
        self.epoch_start = time.perf_counter()      # evaluation time is not training time

    def _gather_params(self) -> None:
        """Server 0: pull the other servers' shards into the full model (as a worker would)."""
        for server in range(1, self.s.servers):
            self.comm.Send(self._int1, dest=server, tag=TAG_PULL)
            self.comm.Recv(self._reply, source=server, tag=TAG_REPLY)
            self.comm.Recv(self.s.shard(self.s.model.params, server), source=server, tag=TAG_PARAMS)

    def _send_final(self) -> None:
        self.comm.Send(np.ascontiguousarray(self.log.rows), dest=0, tag=TAG_FINAL)
        self.comm.Send(self.params, dest=0, tag=TAG_FINAL)
        self.comm.Send(self.optimizer.velocity, dest=0, tag=TAG_FINAL)

    def finish(self) -> Dict[str, Any]:
        """Server 0, after ``serve``: tell the other servers goodbye and collect their logs and shards."""
        velocity = np.zeros_like(self.s.model.params)
        self.s.shard(velocity, 0)[...] = self.optimizer.velocity
        logs = [self.log.rows]
        status = MPI.Status()
        for server in range(1, self.s.servers):
            self.comm.Send(self._int1, dest=server, tag=TAG_BYE)
            self.comm.Probe(source=server, tag=TAG_FINAL, status=status)
            rows = np.zeros((status.Get_count(MPI.INT64_T) // 3, 3), dtype=np.int64)
            self.comm.Recv(rows, source=server, tag=TAG_FINAL)
            self.comm.Recv(self.s.shard(self.s.model.params, server), source=server, tag=TAG_FINAL)
            self.comm.Recv(self.s.shard(velocity, server), source=server, tag=TAG_FINAL)
            logs.append(rows)
        return {"velocity": velocity, "logs": logs}

    # -- failures ---------------------------------------------------------------------------
    def _check_silence(self, now: float) -> None:
        timeout = self.s.options.worker_timeout
        for w in self.s.workers:
            if w not in self.done_workers and now - self.heard[w] > timeout:
                self._abort(f"worker rank {w} has sent nothing for {now - self.heard[w]:.1f} s (last message "
                            f"{self.heard[w] - self.start:.2f} s into the run, after {plural(self.pushes[w], 'gradient')}); "
                            f"presumed dead (--worker-timeout {timeout:g})")

    def _on_failed(self, src: int, nbytes: int) -> None:
        text = np.zeros(max(nbytes, 1), dtype=np.uint8)
        self.comm.Recv(text[:nbytes], source=src, tag=TAG_FAILED)
        self._say_aborting(f"worker rank {src} failed {time.perf_counter() - self.start:.2f} s into the run, after "
                           f"{plural(self.pushes[src], 'gradient')}: {bytes(text[:nbytes]).decode(errors='replace')}")
        self.comm.Send(self._int1, dest=src, tag=TAG_ACK)  # only once the report is out: the worker then aborts too
        end_job(1)

    def _say_aborting(self, why: str) -> None:
        sys.stderr.write(f"{self._aborting(why)}\n")
        flush_for_launcher()

    def _abort(self, why: str) -> NoReturn:
        abort_job(self._aborting(why))

    def _aborting(self, why: str) -> str:
        return f"allreduce_kit.train: parameter server rank {self.rank}: {why}; aborting the job"


class Worker:
    """Rank ``>= K``: pull, compute, push, repeat until server 0 grants nothing more."""

    def __init__(self, setup: _Setup):
        self.s = setup
        self.comm, self.rank = setup.comm, setup.rank
        cfg = setup.config
        self.index = setup.workers.index(self.rank)
        self.delay = cfg.straggler[1] / 1e3 if cfg.straggler and cfg.straggler[0] == self.rank else 0.0
        self.jitter_rng = np.random.default_rng([cfg.seed, 5, self.rank])
        fault = setup.options.fault
        self.fault = fault[1:] if fault and fault[0] == self.rank else None
        self.versions = np.zeros((setup.servers, 2), dtype=np.int64)
        self.headers = np.zeros((setup.servers, 4), dtype=np.float64)
        self._int1 = np.zeros(1, dtype=np.int64)
        self.pushed = 0
        self.order, self.pos, self.epoch = np.zeros(0, dtype=np.int64), 0, 0

    def _take(self, count: int) -> np.ndarray:
        """The next ``count`` sample indices of this worker's stream: its shard of epoch 0, then of 1, ..."""
        while len(self.order) - self.pos < count:
            shard = np.concatenate(data.epoch_batches(len(self.s.data.y_train), len(self.s.workers), self.index,
                                                      self.s.config.batch_size, self.s.config.seed, self.epoch))
            self.order, self.pos, self.epoch = np.concatenate([self.order[self.pos:], shard]), 0, self.epoch + 1
        self.pos += count
        return self.order[self.pos - count:self.pos]

    def _pull(self, server: int) -> int:
        self.comm.Send(self._int1, dest=server, tag=TAG_PULL)
        self.comm.Recv(self.versions[server], source=server, tag=TAG_REPLY)
        grant = int(self.versions[server, 1])
        if grant:
            self.comm.Recv(self.s.shard(self.s.model.params, server), source=server, tag=TAG_PARAMS)
        return grant

    def work(self) -> None:
        try:
            self._loop()
        except Exception as error:            # tell server 0 who failed and why, then let the job abort
            self._report(f"{type(error).__name__}: {error}")
            raise

    def _loop(self) -> None:
        model, cfg = self.s.model, self.s.config
        pending: List[MPI.Request] = []
        while True:
            grant = self._pull(0)
            if grant == 0:
                break
            for server in range(1, self.s.servers):
                self._pull(server)
            MPI.Request.Waitall(pending)         # already done: the servers answered our pull after them
            idx = self._take(grant)
            loss, correct = model.forward_backward(self.s.data.X_train[idx], self.s.data.y_train[idx])
            pause(self.delay)
            if cfg.jitter_ms > 0:
                pause(self.jitter_rng.uniform(0.0, 2.0 * cfg.jitter_ms) / 1e3)
            self._inject_fault()
            pending = []
            for server in range(self.s.servers):
                self.headers[server] = (self.versions[server, 0], len(idx), loss, correct)
                pending.append(self.comm.Isend(self.headers[server], dest=server, tag=TAG_PUSH))
                pending.append(self.comm.Isend(self.s.shard(model.grads, server), dest=server, tag=TAG_GRAD))
            self.pushed += 1
        MPI.Request.Waitall(pending)
        for server in range(1, self.s.servers):
            self.comm.Send(self._int1, dest=server, tag=TAG_BYE)

    def _inject_fault(self) -> None:
        if self.fault and self.pushed == self.fault[0]:
            if self.fault[1] == "hang":
                while True:                       # stops talking; the server's timeout must notice
                    time.sleep(1.0)
            raise RuntimeError(f"injected fault: worker rank {self.rank} crashed after {plural(self.pushed, 'gradient')}")

    def _report(self, text: str) -> None:
        """Send the error to server 0 and give it up to 10 s to acknowledge (it then aborts the job)."""
        message = np.frombuffer(text.encode()[:4000], dtype=np.uint8).copy()
        self.comm.Send(message, dest=0, tag=TAG_FAILED)
        ack = self.comm.Irecv(self._int1, source=0, tag=TAG_ACK)
        deadline = time.perf_counter() + 10.0
        while not ack.Test() and time.perf_counter() < deadline:
            time.sleep(0.01)


def run(config: Config, options: Options, comm: Optional[MPI.Intracomm] = None,
        dataset: Optional[data.Dataset] = None,
        on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None) -> Optional[Dict[str, Any]]:
    """Train with ``options.servers`` parameter servers and the other ranks as workers (collective).

    Returns the run's results on rank 0 (the shape of the synchronous trainer's, plus
    ``staleness`` and ``shutdown``), None elsewhere. Needs at least ``servers + 1`` ranks.
    """
    base = comm if comm is not None else MPI.COMM_WORLD
    pcomm = base.Dup()                           # the parameter server's own context
    try:
        setup = _Setup(config, options, pcomm, dataset)
        if len(setup.workers) < 1:
            raise ValueError(f"async-ps needs at least {options.servers + 1} ranks ({options.servers} server(s) "
                             f"and a worker), got {setup.ranks}")
        hosts = pcomm.allgather(MPI.Get_processor_name())
        setup.warm_up()
        pcomm.Barrier()
        final = None
        if setup.rank < setup.servers:
            role = ParameterServer(setup, on_epoch)
            role.serve()
            if setup.rank == 0:
                final = role.finish()
        else:
            Worker(setup).work()
        pcomm.Barrier()                          # everyone has received everything addressed to them
        left = int(pcomm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))
        in_flight = pcomm.allreduce(left, op=MPI.SUM)
        if setup.rank != 0:
            return None
        return _results(setup, role, final, hosts, in_flight)
    finally:
        pcomm.Free()


def _results(setup: _Setup, server: ParameterServer, final: Dict[str, Any], hosts: List[str],
             in_flight: int) -> Dict[str, Any]:
    cfg, opts, model = setup.config, setup.options, setup.model
    rows = server.log.rows
    rejected_per_server = [int((log[:, 2] == 0).sum()) for log in final["logs"]]
    applied_per_server = [int((log[:, 2] == 1).sum()) for log in final["logs"]]
    history = server.history
    summary = build_summary("async-ps", setup.ranks, len(setup.workers), history, applied_per_server[0],
                            rejected_per_server[0], server.log.applied_staleness())
    saved = None
    if cfg.checkpoint_dir:
        settings = checkpoint.run_settings(cfg.as_dict(), "async-ps")    # the run's identity (checkpoint.py)
        meta = {"ranks": setup.ranks, "widths": model.widths,
                "run": checkpoint.run_identity(settings), "run_settings": settings,
                "dtype": model.dtype.name, "seed": cfg.seed, "mode": "async-ps", "servers": setup.servers,
                "config": cfg.as_dict(), "options": opts.as_dict()}
        saved = checkpoint.save(cfg.checkpoint_dir, applied_per_server[0],
                                {"params": model.params, "velocity": final["velocity"]}, meta,
                                keep=cfg.keep_checkpoints)
    seconds = sum(e["seconds"] for e in history)
    samples = sum(e["samples"] for e in history)
    return {
        "ranks": setup.ranks,
        "hosts": sorted(set(hosts)),
        "parameters": model.size,
        "model": model.describe(),
        "servers": setup.servers,
        "workers": setup.workers,
        "steps": applied_per_server[0],
        "epochs": history,
        "test_accuracy": history[-1]["test_accuracy"] if history else None,
        "samples_per_second": samples / seconds if seconds > 0 else 0.0,
        "train_seconds": seconds,
        "params_digest": digest(model.params),
        "staleness": {"overall": distribution(server.log.applied_staleness()),
                      "workers": per_worker(rows, setup.workers),
                      "max_staleness": opts.max_staleness,
                      "applied_per_server": applied_per_server,
                      "rejected_per_server": rejected_per_server},
        "shutdown": {"workers_stopped": len(server.done_workers), "workers": len(setup.workers),
                     "messages_in_flight": in_flight, "saved": saved},
        "summary": summary,
    }
