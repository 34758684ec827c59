import sys

from mhgpo.cli.main import main

sys.exit(main())
