import os
import sys

from tunekit.cli.main import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # One of several processes, its work done and its files written: exit without the interpreter's teardown,
    # where DeepSpeed's and gloo's C++ threads, outliving the closed process group, can abort the process
    # ("terminate called without an active exception", SIGABRT; seen on CPU ZeRO-3 ranks under load).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
sys.exit(code)
