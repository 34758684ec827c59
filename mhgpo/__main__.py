import sys

from mhgpo.cli import main

sys.exit(main())
