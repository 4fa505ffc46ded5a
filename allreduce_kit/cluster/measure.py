"""Link bandwidth between two nodes, measured with plain TCP: one flow, and several at once.

``python -m allreduce_kit.cluster.measure receive PORT FLOWS SECONDS`` runs on one node: it
accepts ``FLOWS`` connections, counts the bytes they bring in the middle ``SECONDS`` (after a
short warm-up, before the end) and prints bits per second as JSON. ``send HOST PORT FLOWS
SECONDS`` runs on another and sends as fast as the link lets it. ``cluster status`` runs the
pair through ``nsenter``.
"""
import json
import socket
import sys
import threading
import time
from typing import List

#: Seconds of sending before counting starts (TCP's slow start, the bucket's initial burst).
WARM_UP = 0.3
_CHUNK = 1 << 20


def receive(port: int, flows: int, seconds: float) -> float:
    """Bits per second all ``flows`` brought in together over ``seconds`` after the warm-up."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(flows)
    print("listening", flush=True)
    connections = [server.accept()[0] for _ in range(flows)]
    counts: List[int] = [0] * flows
    stop = threading.Event()

    def drain(k: int) -> None:
        buf = bytearray(_CHUNK)
        while not stop.is_set():
            try:
                got = connections[k].recv_into(buf)
            except OSError:  # closed below once counting is over
                return
            if got == 0:
                return
            counts[k] += got

    threads = [threading.Thread(target=drain, args=(k,), daemon=True) for k in range(flows)]
    for t in threads:
        t.start()
    time.sleep(WARM_UP)
    start, before = time.perf_counter(), sum(counts)
    time.sleep(seconds)
    elapsed, after = time.perf_counter() - start, sum(counts)
    stop.set()
    for c in connections:
        c.close()
    server.close()
    return 8 * (after - before) / elapsed


def send(host: str, port: int, flows: int, seconds: float) -> None:
    """Send from ``flows`` connections to ``host`` for the warm-up and ``seconds`` (and a little more)."""
    payload = bytes(_CHUNK)
    end = time.monotonic() + WARM_UP + seconds + 0.5

    def pump() -> None:
        sock = socket.create_connection((host, port), timeout=10)
        try:
            while time.monotonic() < end:
                sock.sendall(payload)
        except OSError:  # the receiver has counted enough and closed
            pass
        finally:
            sock.close()

    threads = [threading.Thread(target=pump) for _ in range(flows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main(argv: List[str]) -> None:
    if argv[:1] == ["receive"] and len(argv) == 4:
        print(json.dumps({"bits_per_second": receive(int(argv[1]), int(argv[2]), float(argv[3]))}), flush=True)
    elif argv[:1] == ["send"] and len(argv) == 5:
        send(argv[1], int(argv[2]), int(argv[3]), float(argv[4]))
    else:
        sys.exit("usage: python -m allreduce_kit.cluster.measure receive PORT FLOWS SECONDS | "
                 "send HOST PORT FLOWS SECONDS")


if __name__ == "__main__":
    main(sys.argv[1:])
