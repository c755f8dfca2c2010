"""`tunekit launch [torchrun options] COMMAND ...`: torchrun for tunekit commands, on one node or several,
with launch failures said in one line. torch's launcher (torch.distributed.run) is used as it is; what this adds
(options checked before anything starts, a taken rendezvous port found first): docs/multi-gpu.md, "Several nodes"."""

from __future__ import annotations

import errno
import logging
import socket
import sys
from typing import Callable

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


def endpoint(text: str) -> tuple[str, int]:
    """HOST[:PORT] -> (host, port); a malformed endpoint is refused in one line."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = text, ""
    host = host.strip("[]")
    if not host or (port_text and not port_text.isdigit()) or not 0 < int(port_text or DEFAULT_PORT) < 65536:
        raise TunekitError(f"--rdzv-endpoint {text}: expected HOST:PORT with a port from 1 to 65535, e.g. "
                           f"--rdzv-endpoint 10.0.0.1:{DEFAULT_PORT}")
    return host, int(port_text or DEFAULT_PORT)


def node_counts(args) -> tuple[int, int]:
    """(min, max) of --nnodes N or MIN:MAX."""
    low, _, high = args.nnodes.partition(":")
    if not low.isdigit() or not (high or low).isdigit() or int(low) < 1 or int(high or low) < int(low):
        raise TunekitError(f"--nnodes {args.nnodes}: expected a number of nodes of at least 1 (or MIN:MAX with "
                           "1 <= MIN <= MAX), e.g. --nnodes 2")
    return int(low), int(high or low)


def world_size(args) -> int | None:
    """--nnodes x --nproc-per-node where both are fixed numbers (None for a node range or auto, gpu, cpu)."""
    low, high = node_counts(args)
    nproc = str(args.nproc_per_node)
    return low * int(nproc) if low == high and nproc.isdigit() else None


def check(args) -> None:
    """What torchrun takes on trust and then fails on late or waits on forever, refused before anything starts."""
    _, most = node_counts(args)
    nproc = str(args.nproc_per_node)
    if nproc not in ("auto", "cpu", "gpu", "xpu") and not (nproc.isdigit() and int(nproc) >= 1):
        raise TunekitError(f"--nproc-per-node {nproc}: expected a number of processes of at least 1 (or auto, gpu, "
                           "cpu), e.g. --nproc-per-node 2")
    if not 0 <= args.node_rank < most:
        raise TunekitError(f"--node-rank {args.node_rank}: with --nnodes {args.nnodes} the nodes are numbered 0 to "
                           f"{most - 1}; give each node its own rank in that range (0 on the node that serves the "
                           "rendezvous)")
    if args.rdzv_endpoint:
        endpoint(args.rdzv_endpoint)
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise TunekitError(f"--master-port {args.master_port}: expected a port from 1 to 65535")


def _rendezvous_address(args) -> tuple[str, int] | None:
    """(host, port) this node serves the rendezvous on, or None when another node does."""
    if args.standalone:
        return None
    if args.rdzv_backend == "static" or not args.rdzv_endpoint:
        host, port = args.master_addr, args.master_port or DEFAULT_PORT
    else:
        host, port = endpoint(args.rdzv_endpoint)
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


def main(argv: list[str], check_command: Callable[[list[str], int | None], None] | None = None) -> int:
    """Launch; `check_command(command, world_size)` refuses a tunekit command (its arguments, its recipe, at the
    launch's world size where it is fixed) before anything starts."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    args = _parse(argv)
    check(args)
    if check_command is not None:
        check_command(args.training_script_args, world_size(args))
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
