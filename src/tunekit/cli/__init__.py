"""The command line: argv -> one library call per verb."""
