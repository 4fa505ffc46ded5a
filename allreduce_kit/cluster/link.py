"""A shaped link: a rate such as ``1gbit`` turned into the ``tc`` commands that hold each direction
of a node's link to it.

Each node has one veth pair to the cluster's bridge. Traffic leaving the node is shaped on the
node's end (``eth0`` in its network namespace), traffic entering it on the bridge's end, each by
a token bucket (``tc qdisc ... tbf``): so a node sends at most the rate and receives at most the
rate, at the same time, as over a full-duplex link. This kernel has no ``netem``, so there is no
added latency: only what the bridge and the kernel's network stack cost.

The bucket's ``burst`` (the bytes it may send back to back) is the rate times ``BURST_SECONDS``,
at least ``MIN_BURST``; its queue holds ``QUEUE_SECONDS`` of traffic at the rate before it drops:
enough for several TCP flows to share the link without losing packets to a short queue.

Every packet between two nodes passes two buckets at the same rate: the sender's way out and the
receiver's way in. A link in hardware sends from its queue at the rate whatever the CPUs do; a
bucket is emptied by the kernel, on CPUs the ranks keep busy, so it often sends late. While it is
late its tokens pile up, but only to the burst: beyond that, the time it could have sent in is
lost; and the clump it sends then does the same to the receiver's bucket, which has been idle
meanwhile. The burst is how late a bucket may be without losing link time: with four nodes each
sending to the next at 250 Mbit/s (TCP alone, nothing else running), the slowest link carried
55-90% of the rate with a burst of 2 ms, 93-95% with 4 ms. The price: a link left idle gets up
to the burst's time back as a faster send afterwards, at most the burst's bytes per idle period.
"""
import re
from typing import List

#: Units ``tc`` accepts for a rate, in bits per second.
_UNITS = {"bit": 1, "kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9, "tbit": 10 ** 12,
          "bps": 8, "kbps": 8 * 10 ** 3, "mbps": 8 * 10 ** 6, "gbps": 8 * 10 ** 9}
#: The bucket holds this many seconds of traffic at the rate ...
BURST_SECONDS = 0.004
#: ... and at least this many bytes (a few full-size packets).
MIN_BURST = 32 << 10
#: The queue in front of the bucket, in seconds of traffic at the rate.
QUEUE_SECONDS = 0.05


def parse_rate(text: str) -> int:
    """Bits per second from a rate such as ``1gbit``, ``250mbit``, ``100mbps`` (tc's units);
    ``ValueError`` for anything else."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"link rate {text!r}: expected a number and one of {', '.join(_UNITS)} (e.g. 1gbit, 250mbit)")
    bits = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if bits < 10 ** 5:
        raise ValueError(f"link rate {text!r}: at least 100kbit")
    return bits


def tbf(device: str, bits_per_second: int) -> List[str]:
    """The ``tc`` command (as a list) that shapes traffic leaving ``device`` to the rate."""
    rate = bits_per_second // 8
    burst = max(MIN_BURST, int(rate * BURST_SECONDS))
    limit = max(2 * burst, int(rate * QUEUE_SECONDS))
    return ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{bits_per_second}bit",
            "burst", str(burst), "limit", str(limit)]


def describe(bits_per_second: int) -> str:
    """A rate for people: ``1 Gbit/s``, ``250 Mbit/s``."""
    for unit, scale in (("Gbit/s", 10 ** 9), ("Mbit/s", 10 ** 6), ("kbit/s", 10 ** 3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second} bit/s"
