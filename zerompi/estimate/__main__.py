"""python -m zerompi.estimate (see cli.py)."""
import sys

from .cli import main

sys.exit(main())
