"""`python -m kube_emulator`."""

import sys

from kube_emulator.cli import main

sys.exit(main())
