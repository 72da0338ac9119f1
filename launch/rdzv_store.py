"""The rendezvous store of a multi-node torchrun job, served by a process of its own.

torchrun's c10d rendezvous keeps its state in a TCPStore that, by default, the first agent serves: when that
agent dies the store goes with it and every other agent fails. Served by this process instead (start it on the
RDZV_HOST node and give every agent ``--rdzv-conf=is_host=false``), the store outlives any agent, so an agent
that dies, node 0's included, can be started again and rejoin the running job. ``launch/multinode.sh`` does
both when ``RDZV_STORE=serve`` (on the RDZV_HOST node) / ``RDZV_STORE=join`` (on the others) is set.

    python -m launch.rdzv_store --port 29500      # serves until SIGTERM or Ctrl-C
"""

from __future__ import annotations

import argparse
import signal

import torch.distributed as dist


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m launch.rdzv_store", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=29500,
                    help="the port every agent's --rdzv-endpoint names (default 29500)")
    args = ap.parse_args(argv)
    if not 0 < args.port < 2**16:
        ap.error(f"--port {args.port} is not a TCP port: give one in 1..65535")
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # delivered to sigwait below, not as an exception mid-start
    # the server listens on every interface; the host name is only where this process's own client connects
    try:
        store = dist.TCPStore("127.0.0.1", args.port, is_master=True, wait_for_workers=False)
    except dist.DistNetworkError as e:
        raise SystemExit(f"rdzv_store: cannot serve on port {args.port} ({str(e).splitlines()[0]}): "
                         "stop what holds it or choose another --port") from None
    print(f"rendezvous store serving on port {store.port}", flush=True)
    signal.sigwait(stop)


if __name__ == "__main__":
    main()
