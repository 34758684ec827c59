"""The `mhgpo` command line: one module per group of sub-commands, flags translated to config keys."""
