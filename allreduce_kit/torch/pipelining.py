"""``torch.distributed.pipelining``'s names over MPI, for CPU tensors and a model split by the user.

::

    from allreduce_kit.torch.pipelining import PipelineStage, Schedule1F1B

    stage = PipelineStage(part_of_the_model, stage_index=rank, num_stages=size)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=torch.nn.functional.cross_entropy)
    losses = []
    schedule.step(x if rank == 0 else None, target=y if rank == size - 1 else None, losses=losses)
    optimizer.step()                               # each rank's own stage's parameters

``step`` cuts the first stage's input (and the last stage's ``target``) into ``n_microbatches``
chunks along dimension 0, runs the rank's list of forwards and backwards (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``: allreduce_kit.pipeline.schedules) and leaves each
stage's parameters holding the gradient of the mean of the micro-batches' losses
(``scale_grads=False``: their sum). The last stage appends each micro-batch's loss to ``losses``
and returns the outputs concatenated. Activations and their gradients travel between neighbouring
stages by nonblocking point-to-point calls on the library's clone of the pipeline's communicator,
tagged per micro-batch, stage and direction. Importing this module does not start MPI (the
first ``PipelineStage`` does, after ``allreduce_kit.torch.init()`` if the script calls it).

At the first ``step`` the stages check that they fit together before any micro-batch runs, as
``torch.distributed.pipelining``'s metadata inference does: stage 0 runs its forward on the first
micro-batch's shape and dtype (on zeros, without autograd), passes its output's shape and dtype to
stage 1, which runs its forward on zeros of them, and so on to the last stage. A stage whose forward
raises on its predecessor's output (another width, another dtype), or whose input or output differs
from the ``input_args`` or ``output_args`` it was given (example tensors: their shape but the first
dimension, and their dtype), makes every rank raise the same ``PipelineShapeError`` naming the stage.
Every wait for another rank (a message not yet sent, a send not yet received) is watched by the stall
inspector (docs/reliability.md): a stage that hangs or dies ends the job, named by the ranks
waiting on it. An exception in a stage's forward or backward carries a note naming the schedule,
the stage, the rank and the micro-batch.

Stage i runs on rank i mod P of the ``group`` (P ranks; default ``COMM_WORLD``): one stage per
rank for ``ScheduleGPipe`` and ``Schedule1F1B``, the stages i, i + P, ... of a rank for
``ScheduleInterleaved1F1B``, as in PyTorch. A stage takes one tensor and returns one tensor.
For data parallelism beside the pipeline, give each pipeline its own ``group`` and average each
stage's gradients over its replicas (``DistributedOptimizer`` over a process set of them).
"""
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..pipeline import schedules
from ..pipeline.schedules import tag_of

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "PipelineShapeError"]

#: The tag of the first step's shape messages (below every tag of a step's activations and gradients).
META_TAG = schedules.TAG_BASE - 1


class PipelineShapeError(ValueError):
    """Stages that do not fit together: raised on every rank at the first ``step``, naming the stage."""


class _Probe:
    """A message from ``source`` with ``tag`` having arrived, as a request the stall inspector waits on."""

    def __init__(self, comm: Any, source: int, tag: int):
        self.comm, self.source, self.tag = comm, source, tag

    def Test(self) -> bool:
        return self.comm.Iprobe(source=self.source, tag=self.tag)

    def Wait(self) -> None:
        self.comm.Probe(source=self.source, tag=self.tag)


def _meta(example: Any) -> Optional[tuple]:
    """(shape but the first dimension, dtype) of an example tensor, or None."""
    if example is None:
        return None
    if isinstance(example, (tuple, list)) and len(example) == 1:
        example = example[0]
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"PipelineStage: input_args and output_args must be one example tensor, got "
                        f"{type(example).__name__}")
    return tuple(example.shape[1:]), example.dtype


def _shown(shape: Sequence[int], dtype: Any) -> str:
    return f"(rows, {', '.join(map(str, shape))}) of {str(dtype).replace('torch.', '')}" if shape else \
        f"(rows,) of {str(dtype).replace('torch.', '')}"


def _communicator(group: Any):
    from mpi4py import MPI                          # not at import: init() may prepare MPI's start first

    if group is None:
        return MPI.COMM_WORLD
    if isinstance(group, MPI.Intracomm):
        return group
    state = getattr(group, "_state", None)           # an allreduce_kit.torch ProcessSet this rank belongs to
    if state is not None and isinstance(getattr(state, "comm", None), MPI.Intracomm):
        return state.comm
    raise TypeError(f"PipelineStage: group must be None, an mpi4py intracommunicator or a ProcessSet this rank "
                    f"belongs to, got {type(group).__name__}")


class PipelineStage:
    """``submodule`` as stage ``stage_index`` of ``num_stages``; ``device`` must be CPU (or None);
    ``input_args`` and ``output_args``, if given, example tensors of what the stage takes and puts
    out (checked at the first step: their shape but the first dimension, and their dtype)."""

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int, device: Any = None,
                 input_args: Any = None, output_args: Any = None, group: Any = None):
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"PipelineStage: device must be the CPU, got {device}")
        for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PipelineStage: {name} must be an int, got {type(value).__name__}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index must be in 0..{num_stages - 1}, got {stage_index}")
        self.submod = submodule
        self.stage_index, self.num_stages = stage_index, num_stages
        self.comm = _communicator(group)
        self.group_rank, self.group_size = self.comm.Get_rank(), self.comm.Get_size()
        if stage_index % self.group_size != self.group_rank:
            raise ValueError(f"PipelineStage: stage {stage_index} runs on rank {stage_index % self.group_size} of the "
                             f"group's {self.group_size}, not on rank {self.group_rank}")
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        #: (shape but the first dimension, dtype) this stage takes and puts out, if given.
        self.input_meta, self.output_meta = _meta(input_args), _meta(output_args)

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index} of {self.num_stages}, rank {self.group_rank})"


class _Schedule:
    """What the three schedules share: the micro-batches, the rank's list, its execution."""
    _name = ""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 scale_grads: bool = True):
        if loss_fn is None:
            raise ValueError(f"{type(self).__name__}: loss_fn is needed (the last stage's backward starts from it)")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: n_microbatches must be an int >= 1, got {n_microbatches!r}")
        stages = list(stages)
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{type(self).__name__}: expected PipelineStage objects")
        first = stages[0]
        P, T = first.group_size, first.num_stages
        if any(s.comm != first.comm or s.num_stages != T for s in stages):
            raise ValueError(f"{type(self).__name__}: the stages must share num_stages and group")
        if T % P:
            raise ValueError(f"{type(self).__name__}: num_stages={T} must be a multiple of the group's {P} ranks")
        V = T // P
        if V > 1 and self._name != "interleaved":
            raise ValueError(f"{type(self).__name__}: one stage per rank (num_stages={T} on {P} ranks); "
                             f"ScheduleInterleaved1F1B runs several")
        if sorted(s.stage_index for s in stages) != [first.group_rank + j * P for j in range(V)]:
            raise ValueError(f"{type(self).__name__}: rank {first.group_rank} must hold stages "
                             f"{[first.group_rank + j * P for j in range(V)]}, got {[s.stage_index for s in stages]}")
        self.stages = {s.stage_index: s for s in stages}
        self.n_microbatches, self.loss_fn, self.scale_grads = n_microbatches, loss_fn, scale_grads
        self.ranks, self.total = P, T
        try:
            self.actions = schedules.build(P, n_microbatches, self._name, V)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}: {error}") from None
        schedules.simulate(self.actions)                 # refuses a list that could hang
        self.mine = self.actions[first.group_rank]
        from ..comm import library_comm
        self.lib = library_comm(first.comm)
        self.checked = False

    def _wait(self, request: Any, peer: int, what: Callable[[], str]) -> None:
        from ..stall import INSPECTOR
        INSPECTOR.wait(request, self.lib.watch, peer, lambda: f"{type(self).__name__}: {what()}")

    def _recv(self, stage: int, source_stage: int, tag: int, what: str) -> Any:
        """The object stage ``source_stage`` sends stage ``stage`` with ``tag``, its wait watched."""
        source = source_stage % self.ranks
        self._wait(_Probe(self.lib, source, tag), source,
                   lambda: f"stage {stage} (rank {self.lib.myrank}) waiting for stage {source_stage} (rank {source}) "
                           f"to send its {what}")
        return self.lib.recv(source=source, tag=tag)

    def _check_shapes(self, first_input: Optional[torch.Tensor], problem: Optional[Exception]) -> None:
        """Every stage's forward on its predecessor's output's shape and dtype, stage 0 to the last,
        before the first micro-batch; a stage that does not fit makes every rank raise
        ``PipelineShapeError`` naming it (the last stage's rank tells every rank the outcome).
        ``problem``: this rank's bad ``step`` argument (the input at stage 0, the target at the
        last), passed along instead, so that every rank raises it."""
        me, last = self.lib.myrank, self.total - 1
        carried: Any = None                         # what the previous stage passed on, where it is on this rank
        for k in sorted(self.stages):
            stage = self.stages[k]
            if k == 0:
                got: Any = problem or (tuple(first_input.shape[1:]), first_input.dtype, first_input.shape[0])
            elif (k - 1) % self.ranks == me:
                got = carried
            else:
                got = self._recv(k, k - 1, META_TAG, "output's shape and dtype (the first step's check)")
            if isinstance(got, tuple):
                got = self._infer(stage, k, *got)
            if k == last and problem is not None and not isinstance(got, (str, Exception)):
                got = problem
            carried = got
            if k < last and (k + 1) % self.ranks != me:
                self._wait(self.lib.isend(got, dest=(k + 1) % self.ranks, tag=META_TAG), (k + 1) % self.ranks,
                           lambda: f"stage {k} (rank {me}) waiting for stage {k + 1} (rank {(k + 1) % self.ranks}) "
                                   f"to receive its output's shape and dtype (the first step's check)")
        from ..stall import INSPECTOR
        with INSPECTOR.watching(self.lib.watch, f"{type(self).__name__}: the first step's shape check (bcast)"):
            outcome = self.lib.bcast(carried if last in self.stages else None, root=last % self.ranks)
        self.checked = True
        if isinstance(outcome, str):
            raise PipelineShapeError(f"{type(self).__name__}: {outcome}")
        if isinstance(outcome, Exception):
            raise type(outcome)(*outcome.args)

    def _infer(self, stage: PipelineStage, k: int, shape: tuple, dtype: Any, rows: int) -> Any:
        """Stage ``k``'s output (shape, dtype, rows) on zeros of its input's, or why it does not fit."""
        came = "the input" if k == 0 else f"stage {k - 1}'s output"
        if stage.input_meta is not None and stage.input_meta != (shape, dtype):
            return (f"stage {k} expects input {_shown(*stage.input_meta)} (input_args), {came} is "
                    f"{_shown(shape, dtype)}")
        try:
            with torch.no_grad():
                out = stage.submod(torch.zeros((rows, *shape), dtype=dtype))
        except Exception as error:            # noqa: B902 - whatever it is, every rank must hear of it
            return f"stage {k}'s forward raised on {came}, {_shown(shape, dtype)}: {type(error).__name__}: {error}"
        if not isinstance(out, torch.Tensor):
            return f"stage {k} returned {type(out).__name__}; a stage returns one tensor"
        got = (tuple(out.shape[1:]), out.dtype)
        if stage.output_meta is not None and stage.output_meta != got:
            return f"stage {k} puts out {_shown(*got)}, its output_args say {_shown(*stage.output_meta)}"
        return (*got, out.shape[0] if out.dim() else 1)

    def step(self, *args: Any, target: Any = None, losses: Optional[List] = None, return_outputs: bool = True,
             **kwargs: Any) -> Optional[torch.Tensor]:
        """One step over the whole batch: the input on the first stage's rank, ``target`` on the
        last's; gradients accumulate into the stages' parameters (call ``zero_grad`` between steps)."""
        M, last = self.n_microbatches, self.total - 1
        inputs: List[torch.Tensor] = []
        targets: List[Any] = []
        problem: Optional[Exception] = None
        if 0 in self.stages:
            if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
                problem = TypeError(f"{type(self).__name__}.step: the first stage takes one tensor")
            elif args[0].dim() == 0 or args[0].shape[0] < M:
                rows = args[0].shape[0] if args[0].dim() else 0
                problem = ValueError(f"{type(self).__name__}.step: a batch of {rows} cannot be cut into {M} "
                                     f"micro-batches")
            else:
                inputs = list(torch.tensor_split(args[0], M, dim=0))
        if last in self.stages and problem is None:
            if target is None:
                problem = ValueError(f"{type(self).__name__}.step: the last stage needs target for loss_fn")
            else:
                targets = list(torch.tensor_split(target, M, dim=0))
        if not self.checked:                        # at the first step, every rank raises a rank's bad argument
            self._check_shapes(inputs[0] if inputs else None, problem)
        elif problem is not None:
            raise problem
        peer = lambda stage: stage % self.ranks
        kept: Dict[tuple, tuple] = {}
        outputs: Dict[int, torch.Tensor] = {}
        sends: List[Any] = []
        for a in self.mine:
            try:
                stage = self.stages[a.stage]
                if a.kind == "F":
                    if a.stage == 0:
                        x = inputs[a.mb]
                    else:
                        x = torch.from_numpy(self._recv(a.stage, a.stage - 1, tag_of("F", a.mb, a.stage, self.total),
                                                        f"activations of micro-batch {a.mb}"))
                        x.requires_grad_(True)
                    out = stage.submod(x)
                    if not isinstance(out, torch.Tensor):
                        raise TypeError(f"stage {a.stage} returned {type(out).__name__}; a stage returns one tensor")
                    if a.stage == last:
                        outputs[a.mb] = out.detach()
                        out = self.loss_fn(out, targets[a.mb])
                        if losses is not None:
                            losses.append(out.detach())
                    else:
                        sends.append((self.lib.isend(out.detach().numpy(), dest=peer(a.stage + 1),
                                                     tag=tag_of("F", a.mb, a.stage + 1, self.total)), a, a.stage + 1))
                    kept[(a.mb, a.stage)] = (x, out)
                else:
                    x, out = kept.pop((a.mb, a.stage))
                    if a.stage == last:
                        out.backward()
                    else:
                        grad = torch.from_numpy(self._recv(a.stage, a.stage + 1, tag_of("B", a.mb, a.stage, self.total),
                                                           f"gradient of micro-batch {a.mb}"))
                        torch.autograd.backward(out, grad_tensors=grad)
                    if a.stage > 0:
                        sends.append((self.lib.isend(x.grad.numpy(), dest=peer(a.stage - 1),
                                                     tag=tag_of("B", a.mb, a.stage - 1, self.total)), a, a.stage - 1))
            except Exception as error:
                error.add_note(f"in {type(self).__name__}'s stage {a.stage} on rank {self.lib.myrank}: the "
                               f"{'forward' if a.kind == 'F' else 'backward'} of micro-batch {a.mb}")
                raise
        for request, a, to in sends:
            what = "activations" if a.kind == "F" else "gradient"
            self._wait(request, peer(to), lambda: f"stage {a.stage} (rank {self.lib.myrank}) waiting for stage {to} "
                                                  f"(rank {peer(to)}) to receive its {what} of micro-batch {a.mb}")
        if self.scale_grads and M > 1:
            for stage in self.stages.values():
                for p in stage.submod.parameters():
                    if p.grad is not None:
                        p.grad.div_(M)
        if last in self.stages and return_outputs:
            return torch.cat([outputs[mb] for mb in range(M)], dim=0)
        return None


class ScheduleGPipe(_Schedule):
    """All forwards, then all backwards (GPipe)."""
    _name = "gpipe"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable] = None,
                 scale_grads: bool = True):
        super().__init__([stage], n_microbatches, loss_fn, scale_grads)


class Schedule1F1B(_Schedule):
    """One forward, one backward (PipeDream-Flush): at most as many micro-batches live as stages."""
    _name = "1f1b"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable] = None,
                 scale_grads: bool = True):
        super().__init__([stage], n_microbatches, loss_fn, scale_grads)


class ScheduleInterleaved1F1B(_Schedule):
    """Several stages per rank (stage i on rank i mod P), 1F1B over them (Megatron-LM's order);
    ``n_microbatches`` at most P or a multiple of P."""
    _name = "interleaved"

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 scale_grads: bool = True):
        super().__init__(stages, n_microbatches, loss_fn, scale_grads)
