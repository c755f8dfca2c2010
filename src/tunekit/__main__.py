import os
import sys

from tunekit.cli.main import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK", "0") != "0":
    # A rank other than 0, its work done (rank 0 writes every file and runs the trackers, whose exit hooks must
    # run): exit without the interpreter's teardown, where DeepSpeed's and gloo's C++ threads, outliving the
    # closed process group, can abort the process ("terminate called without an active exception", SIGABRT;
    # seen on a CPU ZeRO-3 rank under load).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
sys.exit(code)
