"""`tunekit launch [torchrun options] COMMAND ...`: torchrun for tunekit commands, on one node or several,
with launch failures said in one line.

torch's launcher (torch.distributed.run) is used as it is: same options, same rendezvous, same elastic agent.
What it does not do, this adds: a rendezvous port already taken on the rendezvous host is found before the
launch (torch's c10d rendezvous would connect to whatever listens there and wait until killed); a node that
never joins, and a rank that fails, end in one line instead of torch's tracebacks."""

from __future__ import annotations

import errno
import logging
import socket
import sys

from tunekit.core.errors import TunekitError

log = logging.getLogger("tunekit")
DEFAULT_PORT = 29500


def _parse(argv: list[str]):
    """torchrun's own parser; the tunekit command (`train RECIPE ...`) takes the place of its script."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tunekit launch"

    def refuse(message: str):
        raise TunekitError(f"tunekit launch: {message}; give torchrun options, then a tunekit command, e.g. tunekit "
                           "launch --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:29500 train RECIPE")

    parser.error = refuse  # argparse's usage block would bury the one line that matters
    args = parser.parse_args(argv)
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script, args.module, args.no_python = "tunekit", True, False
    return args


def _rendezvous_address(args) -> tuple[str, int] | None:
    """(host, port) this node serves the rendezvous on, or None when another node does."""
    if args.standalone:
        return None
    if args.rdzv_backend == "static" or not args.rdzv_endpoint:
        host, port = args.master_addr, args.master_port or DEFAULT_PORT
    else:
        host, _, port_text = args.rdzv_endpoint.rpartition(":")
        host, port = (host, int(port_text)) if host else (args.rdzv_endpoint, DEFAULT_PORT)
    return (host, int(port)) if args.node_rank == 0 else None


def check_port(host: str, port: int) -> None:
    """The rendezvous port must be free on the node that serves it."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except socket.gaierror as e:
        raise TunekitError(f"--rdzv-endpoint {host}:{port}: the host does not resolve ({e.strerror}); give the "
                           "rendezvous node's address or name") from None
    for address in addresses:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            try:
                s.bind((address, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise TunekitError(
                        f"--rdzv-endpoint {host}:{port}: the port is already in use on this node (another run, or "
                        "another service); choose a free port, the same on every node") from None
                if e.errno != errno.EADDRNOTAVAIL:  # not an address of this machine: another node serves it
                    raise


def _first_failure(err) -> str:
    """`rank R on this node (H) ended with exit code C` for the first of this node's ranks that failed."""
    rank, failure = min(err.failures.items())
    what = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"signal {-failure.exitcode}"
    return f"rank {rank} on this node ({socket.gethostname()}) ended with {what}"


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    args = _parse(argv)
    served = _rendezvous_address(args)
    if served is not None:
        check_port(*served)
    if args.master_port is None:
        args.master_port = DEFAULT_PORT
    config, cmd, cmd_args = config_from_args(args)
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # their tracebacks; the outcome is said below
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except RendezvousTimeoutError:
        timeout = config.rdzv_configs.get("join_timeout", 600)
        raise TunekitError(
            f"--rdzv-endpoint {args.rdzv_endpoint or args.master_addr}: not every node joined within {timeout} s "
            f"(--nnodes {args.nnodes}); start the same command on every node, and check the address, the port and "
            "the firewall between them (--rdzv-conf join_timeout=S waits longer)") from None
    except ChildFailedError as e:
        raise TunekitError(f"{_first_failure(e)}; the other ranks were stopped (each rank's own "
                           "error line is above); after fixing it, relaunch every node with train ... --resume "
                           "to continue from the last complete checkpoint") from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
