"""The network in the bench's output: nodes, ranks per node, the link's bandwidth, and "link %".

On a run whose ranks span N nodes, each node's link must carry at least 2(N-1)/N of the message
each way for an allreduce, whatever the algorithm (every node must send what the others lack of
its data, and receive theirs); (N-1)/N of the whole buffer for a reduce-scatter or an allgather
(a node's partial results for the other nodes' blocks leave it, or the other nodes' blocks
reach it), and the whole buffer for a broadcast (it reaches every node but the root's).
"link %" is that many bytes divided by the call's time and the link's bandwidth: 100 means the
call ran at the link's speed, as fast as the link allows.

The bandwidth is ``--link-gbps`` if given; else, on the emulated cluster (``allreduce_kit.cluster``),
the bandwidth its last ``status`` (or ``up``) measured with one TCP flow, else the rate it shapes
links to. Without either, rows have no "link %".
"""
import json
from typing import List, Optional, Tuple

from ..topology import Topology


def cluster_link() -> Optional[Tuple[float, str]]:
    """The emulated cluster's link bandwidth in bits per second and where it comes from, or None."""
    from ..cluster import STATE_FILE

    try:
        state = json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return None
    measured = (state.get("measured") or {}).get("1 flow")
    if measured:
        return float(measured), "measured by 'cluster status', one TCP flow"
    bits = state.get("link_bits")
    return (float(bits), "the emulated cluster's shaped rate (not measured)") if bits else None


def link_bandwidth(layout: Topology, gbps: Optional[float]) -> Optional[Tuple[float, str]]:
    """Bits per second of a node's link for this run and where the figure comes from; None on one
    node or where nothing says."""
    if layout.single_node:
        return None
    if gbps:
        return gbps * 1e9, "--link-gbps"
    return cluster_link()


#: What each node's link must carry of the message, each way, as the formula the preamble prints.
_LEAST = {"allreduce": "2(N-1)/N x size", "reduce_scatter": "(N-1)/N x size", "allgather": "(N-1)/N x size",
          "broadcast": "size"}


def least_share(collective: str, nodes: int) -> float:
    """The share of the message (the whole buffer) each node's link must carry each way."""
    if collective == "broadcast":
        return 1.0
    return (2 if collective == "allreduce" else 1) * (nodes - 1) / nodes


def describe(layout: Topology, link: Optional[Tuple[float, str]], collective: str = "allreduce") -> List[str]:
    """The preamble's lines about nodes and links."""
    per_node = ", ".join(str(c) for c in layout.ranks_per_node)
    lines = [f"nodes: {layout.nodes} ({', '.join(layout.hosts)}), ranks per node: {per_node}"]
    if not layout.single_node:
        if link is None:
            lines.append("link bandwidth unknown (give --link-gbps): no link % column")
        else:
            lines.append(f"link: {link[0] / 1e9:.3f} Gbit/s per node each way ({link[1]}); link % = "
                         f"{_LEAST[collective]} / time / link bandwidth, N = {layout.nodes} nodes")
    return lines


def link_percent(size: int, time_us: float, nodes: int, bits_per_second: float,
                 collective: str = "allreduce") -> float:
    """The share of the link's bandwidth a call of ``size`` bytes (the whole buffer) in ``time_us``
    used: what each node's link must carry (``least_share``: 2(N-1)/N x size for an allreduce) /
    time / bandwidth, in percent."""
    if time_us <= 0:
        return 0.0
    return 100 * least_share(collective, nodes) * size * 8 / (time_us * 1e-6) / bits_per_second
