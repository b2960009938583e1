#!/usr/bin/env python3
"""The network between the test hosts: a switch in user space, with faults on demand.

    link.py <tun name prefix> <namespace>... --state FILE [--ready FILE]

Makes one TUN device per namespace (<prefix>0, <prefix>1, ...), moves each into its namespace
(where hosts.sh names it eth0 and gives it its address) and then forwards every IPv4 packet a host
sends to the host its destination address names (10.x.y.K goes to host K, counted from 1). Nothing
reaches any other network: the devices exist only inside the namespaces, and this process is the
only thing joining them.

Faults, per host, on the packets that host sends (as netem on its interface would) and, for
`down`, on those it receives too; read from the state file, one line per host that has any:

    <host number> down                  the host is cut off: every packet to or from it vanishes
    <host number> delay <ms> loss <p>   each packet it sends waits <ms> ms and is lost with
                                        probability p (0..1)

A SIGHUP makes it read the state file again (hosts.sh's mh_link does both). The kernel here has no
netem (and no tc classifier that drops at random), which is why the link is emulated: TCP above it
is the kernel's own, so retransmission, keepalive and timeouts behave as on a real wire.
Losses come from a seeded generator (the same faults in every run). Ends on SIGTERM or SIGINT, or
when the process that started it is gone.
"""
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def read_state(path, hosts):
    faults = {k: {"down": False, "delay": 0.0, "loss": 0.0} for k in range(1, hosts + 1)}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return faults
    for line in lines:
        words = line.split()
        if not words:
            continue
        host = int(words[0])
        if host not in faults:
            sys.exit(f"link.py: {path}: no host {host} (there are {hosts})")
        if words[1:] == ["down"]:
            faults[host]["down"] = True
        elif len(words) == 5 and words[1] == "delay" and words[3] == "loss":
            faults[host]["delay"] = float(words[2]) / 1000.0
            faults[host]["loss"] = float(words[4])
        else:
            sys.exit(f"link.py: {path}: cannot read '{line}'")
    return faults


def main():
    args = sys.argv[1:]
    state = ready = None
    if "--ready" in args:
        i = args.index("--ready")
        ready = args[i + 1]
        del args[i:i + 2]
    if "--state" in args:
        i = args.index("--state")
        state = args[i + 1]
        del args[i:i + 2]
    if state is None or len(args) < 2:
        sys.exit(__doc__)
    prefix, namespaces = args[0], args[1:]
    hosts = len(namespaces)

    fds = []
    for k, ns in enumerate(namespaces):
        name = f"{prefix}{k}"
        fds.append(open_tun(name))
        # The open descriptor stays attached to the device when it moves to the namespace.
        subprocess.run(["ip", "link", "set", name, "netns", ns], check=True)
    host_of_fd = {fd: k + 1 for k, fd in enumerate(fds)}

    faults = read_state(state, hosts)
    reload = False
    stop = False

    def on_hup(signum, frame):
        nonlocal reload
        reload = True

    def on_term(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGHUP, on_hup)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    if ready:
        with open(ready, "w") as f:
            f.write(f"{os.getpid()}\n")

    rng = random.Random(20)
    queue = []  # (due, sequence, destination fd, packet): delayed packets
    sequence = 0
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)

    def deliver(fd, packet):
        try:
            os.write(fd, packet)
        except OSError:
            pass  # the destination's interface is down, or its queue is full: the packet is lost

    parent = os.getppid()
    while not stop and os.getppid() == parent:  # ends with the test that made it, however it ended
        if reload:
            reload = False
            faults = read_state(state, hosts)
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, fd, packet = heapq.heappop(queue)
            deliver(fd, packet)
        timeout = 100 if not queue else max(0, min(100, int((queue[0][0] - now) * 1000) + 1))
        for fd, _ in poller.poll(timeout):
            source = host_of_fd[fd]
            for _ in range(64):  # drain, a bounded number per wake-up
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if len(packet) < 20 or packet[0] >> 4 != 4:
                    continue  # not IPv4 (the devices carry nothing else that matters here)
                destination = packet[19]
                if destination < 1 or destination > hosts or destination == source:
                    continue
                f = faults[source]
                if f["down"] or faults[destination]["down"]:
                    continue
                if f["loss"] > 0 and rng.random() < f["loss"]:
                    continue
                if f["delay"] > 0:
                    sequence += 1
                    heapq.heappush(queue, (time.monotonic() + f["delay"], sequence, fds[destination - 1], packet))
                else:
                    deliver(fds[destination - 1], packet)


if __name__ == "__main__":
    main()
