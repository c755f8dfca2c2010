import sys

from tunekit.cli.main import main

sys.exit(main())
