"""What a tbf-shaped link of bench/netns.py carries: TCP payload per second
between two emulated hosts, the rate bench/slow_network.py's exchanges can
reach at best. tbf counts whole frames (Ethernet, IP and TCP headers
included), so the payload rate is about 4 % below the configured rate, and
an exchange of B bytes takes at least B / goodput.

    sudo /usr/bin/python3 bench/link_goodput.py --rates 100,1000 --out bench/results/link_goodput.json

Rank 0 streams --megabytes MiB to rank 1 over one TCP connection; rank 1
times from the first byte received to the last. Prints one line per rate
and run; writes the figures as JSON with --out.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from netns import emulated_hosts  # noqa: E402

PORT = 5599

RECEIVER = r"""
import socket, sys, time
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(1)
print("listening", flush=True)
connection, _ = server.accept()
received, first = 0, None
while True:
    data = connection.recv(1 << 20)
    if not data:
        break
    if first is None:
        first = time.perf_counter()
    received += len(data)
print(received, time.perf_counter() - first, flush=True)
"""

SENDER = r"""
import socket, sys
connection = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])):
    connection.sendall(block)
connection.close()
"""


def measure(rate_mbit: int, megabytes: int) -> dict:
    """One transfer of `megabytes` MiB over a link shaped to `rate_mbit`."""
    with emulated_hosts(2, rates_mbit={0: rate_mbit, 1: rate_mbit}) as hosts:
        (sender_ns, _, _), (receiver_ns, _, receiver_address) = hosts
        receiver = subprocess.Popen(
            ["ip", "netns", "exec", receiver_ns, sys.executable, "-c", RECEIVER, receiver_address, str(PORT)],
            stdout=subprocess.PIPE, text=True)
        try:
            if receiver.stdout.readline().strip() != "listening":
                raise SystemExit("link_goodput: the receiver did not start")
            subprocess.run(["ip", "netns", "exec", sender_ns, sys.executable, "-c", SENDER, receiver_address,
                            str(PORT), str(megabytes)], check=True, timeout=600)
            received, seconds = receiver.communicate(timeout=60)[0].split()
        finally:
            receiver.kill()
    goodput = int(received) * 8 / float(seconds) / 1e6
    return {"rate_mbit": rate_mbit, "bytes": int(received), "seconds": float(seconds),
            "goodput_mbit": goodput, "goodput_over_rate": goodput / rate_mbit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,1000", help="Mbit/s, comma-separated")
    parser.add_argument("--megabytes", type=int, default=0,
                        help="MiB per transfer (default: about 2 s of the rate)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    results = []
    for rate in (int(r) for r in args.rates.split(",")):
        megabytes = args.megabytes or max(8, rate * 2 // 8)
        for run in range(args.runs):
            result = measure(rate, megabytes)
            results.append(result)
            print(f"{rate} Mbit/s (tbf), run {run + 1}: {result['bytes'] / 1e6:.1f} MB in {result['seconds']:.3f} s, "
                  f"goodput {result['goodput_mbit']:.1f} Mbit/s ({result['goodput_over_rate']:.4f} of the rate)",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "when": time.strftime("%Y-%m-%d %H:%M:%S")},
                                             indent=1))


if __name__ == "__main__":
    main()
